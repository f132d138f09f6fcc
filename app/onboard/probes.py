"""The fixed probe set `app.onboard.parity` runs a model on, by its reference library and by
shoal: texts of several lengths, languages and scripts, query/document groups, zero-shot
labels, generation prompts and a few images drawn at run time.

Fixed so that figures measured today compare with figures measured next month; varied so
that what usually breaks parity shows: a prompt or pooling choice, lowercasing, a
tokenizer's handling of non-Latin scripts and emoji, and truncation (LONG_TEXT is longer
than 256 tokens of any subword tokenizer, past a small model's max_seq_length).
"""

from __future__ import annotations

from io import BytesIO
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

# About 230 words: 300+ tokens for WordPiece/BPE tokenizers, so every model with a limit of
# 256 or less (and the tiny test models' 64-128) encodes a truncated version of it.
LONG_TEXT = (
    "The history of the river port begins long before the first written records. "
    "Fishermen built wooden piers along the northern bank, and traders from the hills "
    "brought wool, salt and timber down to the water every spring. Over the centuries the "
    "settlement grew into a market town with a stone bridge, a customs house and a "
    "cathedral whose tower could be seen from every road leading into the valley. "
    "In the nineteenth century the railway arrived, and with it factories that spun cotton, "
    "brewed beer and forged the iron for new ships. Workers came from the surrounding "
    "villages and from abroad, living in narrow houses built in rows behind the docks. "
    "Floods remained a constant danger: in one particularly wet autumn the water rose "
    "above the market square, and the townspeople rowed boats between the church and the "
    "town hall. After that disaster engineers raised the embankments, dug a second channel "
    "and installed pumps that still run today. The twentieth century brought decline and "
    "renewal. Most factories closed, the docks fell silent, and many young people left for "
    "the capital. Later the old warehouses were turned into apartments, studios and a "
    "museum of industry, while the riverbank became a park with cycling paths, cafés and "
    "an open-air theatre. Today visitors come to walk along the water, to watch the rowing "
    "races in summer and to taste the local cheese, which is still made according to a "
    "recipe that monks wrote down more than five hundred years ago."
)

TEXTS: tuple[str, ...] = (
    "Hello world",
    "The cat sleeps on the warm mat by the window.",
    "A man is playing a guitar on the street corner while people walk by.",
    "How do I reset my password if I no longer have access to my email account?",
    "Angela Merkel met Arnold Schwarzenegger at the Microsoft offices in Berlin on Monday.",
    "Die Katze schläft auf der warmen Matte am Fenster. Grüße aus Köln: Straße, Äpfel und Öl.",
    "Le chat dort sur le tapis chaud près de la fenêtre, et il rêve de souris.",
    "今天天气很好，我们去公园散步吧。猫在窗边的垫子上睡觉。",  # noqa: RUF001 (Chinese punctuation)
    "القطة نائمة على السجادة الدافئة بجانب النافذة.",
    "Great job everyone!!! 🎉🚀🔥 Let's ship it 👍",
    "Stocks fell sharply after the central bank raised interest rates by half a percentage "
    "point, the largest increase in two decades, citing persistent inflation.",
    LONG_TEXT,
)

# Each query with documents to rank: one relevant, one unrelated, one long or in another
# language, so a reranker's order (not only its scores) is checked.
QUERY_DOCUMENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Where is the cat sleeping?", (
        "The cat sleeps on the warm mat by the window.",
        "Stocks fell sharply after the central bank raised interest rates.",
        "Die Katze schläft auf der warmen Matte am Fenster.",
    )),
    ("how to reset a forgotten password", (
        "To reset your password, open the login page and click 'Forgot password'.",
        "The river port was founded by fishermen centuries ago.",
        LONG_TEXT,
    )),
    ("什么是通货膨胀？", (  # noqa: RUF001 (Chinese punctuation)
        "通货膨胀是指物价水平持续上涨。",
        "Inflation is a sustained rise in the general price level.",
        "Great job everyone!!! 🎉🚀🔥",
    )),
)

# (query, document) in order: the queries' documents one after another.
PAIRS: tuple[tuple[str, str], ...] = tuple(
    (query, document) for query, documents in QUERY_DOCUMENTS for document in documents
)

ZERO_SHOT_LABELS: tuple[str, ...] = ("sports", "politics", "science", "food", "travel")

# Plain completions (a BOS token where the tokenizer adds one) and chat conversations
# (rendered by the model's chat template), greedy-decoded.
COMPLETION_PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "def fibonacci(n):",
)
CHAT_PROMPTS: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "user", "content": "Name three colours of the rainbow."},),
    ({"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}),
)

# (width, height) of each probe image: a landscape, a square and a tall one, so that the
# processors' resize and centre crop all have work to do.
IMAGE_SIZES: tuple[tuple[int, int], ...] = ((96, 64), (48, 48), (40, 120))


def probe_images() -> list[Image.Image]:
    """Three RGB images drawn here, the same pixels on every call: a colour gradient, a
    checkerboard and a disc on a coloured ground."""
    import numpy as np
    from PIL import Image

    (w0, h0), (w1, h1), (w2, h2) = IMAGE_SIZES
    x, y = np.meshgrid(np.linspace(0, 1, w0), np.linspace(0, 1, h0))
    gradient = np.stack([x * 255, y * 255, (1 - x) * 200 + 30], axis=-1)
    ys, xs = np.indices((h1, w1))
    squares = ((ys // 8 + xs // 8) % 2).astype(bool)
    checker = np.where(squares[..., None], [230, 40, 40], [20, 20, 160])
    ys, xs = np.indices((h2, w2))
    inside = (xs - w2 / 2) ** 2 + (ys - h2 / 2) ** 2 < (w2 / 3) ** 2
    disc = np.where(inside[..., None], [250, 220, 30], [30, 140, 60])
    return [Image.fromarray(np.asarray(a).astype(np.uint8), "RGB")
            for a in (gradient, checker, disc)]


def png_bytes(image: Image.Image) -> bytes:
    """An image as PNG bytes (lossless: decoded, the same pixels), as a caller sends it."""
    buffer = BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
