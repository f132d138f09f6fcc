"""The clip adapter (CLIP, SigLIP) against transformers on the same tiny weights."""

from __future__ import annotations

import base64
import struct
import zlib
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

from runtimes.base import Outcome, Request
from runtimes.child_side.host import ModelHost
from tasks.catalog import ModelEntry
from tasks.results import embedding_rows
from tests.tiny_clip import (
    CLIP_MAX_TOKENS,
    PROJECTION_DIM,
    SIGLIP_DIMS,
    SIGLIP_MAX_TOKENS,
    build_tiny_clip,
    build_tiny_siglip,
)

CLIP = "test/tiny-clip"
SIGLIP = "test/tiny-siglip"
DIMS = {CLIP: PROJECTION_DIM, SIGLIP: SIGLIP_DIMS}
MAX_TOKENS = {CLIP: CLIP_MAX_TOKENS, SIGLIP: SIGLIP_MAX_TOKENS}


def image_bytes(color: tuple[int, ...] = (200, 30, 40), size: tuple[int, int] = (40, 30),
                fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """A plain colour crossed by gradient lines, so resizing and cropping matter."""
    image = Image.new(mode, size, color)
    for x in range(size[0]):
        for y in range(0, size[1], 3):
            pixel = ((x * 7) % 256, (y * 5) % 256, 90)
            image.putpixel((x, y), (*pixel, x % 256) if mode == "RGBA" else pixel)
    out = BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` (its pixel data is never read)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0"))
            + chunk(b"IEND", b""))


def sideways_jpeg() -> bytes:
    """A JPEG stored sideways whose EXIF orientation (6: rotate 90°) stands it upright."""
    image = Image.open(BytesIO(image_bytes((90, 90, 200), (48, 24))))
    exif = image.getexif()
    exif[0x0112] = 6
    out = BytesIO()
    image.save(out, "JPEG", exif=exif.tobytes())
    return out.getvalue()


PNG = image_bytes()
JPEG = image_bytes((10, 120, 250), (24, 48), "JPEG")
TRANSPARENT = image_bytes((0, 0, 0, 0), (32, 32), "PNG", "RGBA")
GIF = image_bytes((0, 200, 0), (33, 33), "GIF")
TEXTS = ["a photo of a cat", "", "Grüße aus Köln 🚀", "long " * 100]
# Text and image items interleaved: each vector must come back in its item's place.
ITEMS: list[dict[str, Any]] = [
    {"text": TEXTS[0]}, {"image": PNG}, {"image": JPEG}, {"text": TEXTS[1]},
    {"image": TRANSPARENT}, {"text": TEXTS[2]}, {"image": GIF}, {"text": TEXTS[3]},
    {"image": sideways_jpeg()},
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clip")
    return {CLIP: build_tiny_clip(root / "clip"), SIGLIP: build_tiny_siglip(root / "siglip")}


def entry(model_id: str, path: Path, **extra: Any) -> ModelEntry:
    extra.setdefault("dims", DIMS.get(model_id))
    return ModelEntry.model_validate({"id": model_id, "adapter": "clip",
                                      "source": {"path": str(path)}, **extra})


def host_for(dirs: dict[str, Path], model: str, chunk_tokens: int = 16_384,
             **extra: Any) -> ModelHost:
    host = ModelHost(chunk_tokens=chunk_tokens)
    host.load([entry(model, dirs[model], **extra)])
    return host


@pytest.fixture(scope="module")
def host(dirs: dict[str, Path]) -> ModelHost:
    host = ModelHost()
    host.load([entry(CLIP, dirs[CLIP]), entry(SIGLIP, dirs[SIGLIP])])
    return host


def run(host: ModelHost, model: str, *kwargs_list: dict[str, Any]) -> list[Outcome]:
    requests = [Request(str(i), "encode", {"model": model, **kw})
                for i, kw in enumerate(kwargs_list)]
    return host.run_batch(model, requests)


def vectors(outcome: Outcome) -> np.ndarray:
    assert outcome.ok, outcome.error_message
    return np.array(embedding_rows(outcome.result), dtype=np.float64)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


@torch.inference_mode()
def reference(path: Path, items: list[dict[str, Any]], siglip: bool,
              prompt: str = "") -> np.ndarray:
    """Unnormalised vectors straight from transformers, one item at a time."""
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = AutoImageProcessor.from_pretrained(path, backend="pil")
    out = []
    for item in items:
        if "text" in item:
            inputs = tokenizer([prompt + item["text"]], truncation=True,
                               padding="max_length" if siglip else "longest",
                               max_length=tokenizer.model_max_length, return_tensors="pt")
            inputs.pop("token_type_ids")
            features = model.get_text_features(**inputs)
        else:
            # Upright as transformers' load_image does; the processor converts to RGB.
            image = ImageOps.exif_transpose(Image.open(BytesIO(item["image"])))
            features = model.get_image_features(**processor(images=image, return_tensors="pt"))
        out.append(features.pooler_output[0].numpy())
    return np.array(out, dtype=np.float64)


@pytest.mark.parametrize("model", [CLIP, SIGLIP])
def test_matches_transformers(host, dirs, model):
    (outcome,) = run(host, model, {"items": ITEMS})
    result = outcome.result
    ours = vectors(outcome)
    assert (result["output"], result["dtype"], result["dims"], result["count"]) == \
        ("dense", "float32", DIMS[model], len(ITEMS))
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, rtol=1e-5)
    expected = reference(dirs[model], ITEMS, siglip=model == SIGLIP)
    assert cosines(ours, expected).min() >= 0.9999
    # The random towers give unrelated vectors to different inputs; a swap would show.
    assert cosines(ours, np.roll(expected, 1, axis=0)).max() < 0.99


@pytest.mark.parametrize("model", [CLIP, SIGLIP])
def test_usage_counts_text_tokens_and_images(host, dirs, model):
    (outcome,) = run(host, model, {"items": ITEMS})
    tokenizer = AutoTokenizer.from_pretrained(dirs[model])
    text_tokens = sum(len(tokenizer(t, truncation=True)["input_ids"]) for t in TEXTS)
    assert outcome.result["usage"] == {"tokens": text_tokens + 5 * 50}
    assert text_tokens < 4 * MAX_TOKENS[model]  # padding is not counted


@pytest.mark.parametrize("model", [CLIP, SIGLIP])
def test_deterministic_and_independent_of_batching(host, model):
    (whole,) = run(host, model, {"items": ITEMS})
    np.testing.assert_array_equal(vectors(whole), vectors(run(host, model, {"items": ITEMS})[0]))
    split = run(host, model, *({"items": [item]} for item in ITEMS))  # one batch
    alone = [run(host, model, {"items": [item]})[0] for item in ITEMS]  # a batch each
    for outcomes in (split, alone):
        assert cosines(vectors(whole), np.vstack([vectors(o) for o in outcomes])).min() >= 0.9999


def test_texts_in_several_chunks(dirs):
    (whole,) = run(host_for(dirs, CLIP), CLIP, {"items": ITEMS * 3})
    (small,) = run(host_for(dirs, CLIP, chunk_tokens=40), CLIP, {"items": ITEMS * 3})
    assert cosines(vectors(whole), vectors(small)).min() >= 0.9999


def test_siglip_pads_texts_to_its_full_length(host, dirs):
    short = [{"text": "a cat"}, {"text": "a photo of two dogs"}]
    (outcome,) = run(host, SIGLIP, {"items": short})
    assert cosines(vectors(outcome), reference(dirs[SIGLIP], short, siglip=True)).min() >= 0.9999
    # Padded to the longest instead, SigLIP pools another position: a different vector.
    assert cosines(vectors(outcome), reference(dirs[SIGLIP], short, siglip=False)).max() < 0.99


def test_base64_image_is_the_same_image(host):
    raw, text = run(host, CLIP, {"items": [{"image": PNG}]},
                    {"items": [{"image": base64.b64encode(PNG).decode()}]})
    np.testing.assert_array_equal(vectors(raw), vectors(text))


@pytest.mark.parametrize("dtype,width", [("float32", 4 * 16), ("float16", 2 * 16),
                                         ("int8", 16), ("binary", 2)])
def test_dtypes(host, dtype, width):
    (outcome,) = run(host, CLIP, {"items": ITEMS[:3], "options": {"dtype": dtype}})
    result = outcome.result
    assert result["dtype"] == dtype and len(result["embeddings"]) == 3 * width
    rows = vectors(outcome)
    full = vectors(run(host, CLIP, {"items": ITEMS[:3]})[0])
    if dtype == "binary":
        assert np.array_equal(np.unpackbits(np.asarray(rows, np.uint8), axis=1), full > 0)
    else:
        assert cosines(rows, full).min() >= 0.999


def test_dimensions_and_normalize_options(host, dirs):
    full = vectors(run(host, CLIP, {"items": ITEMS, "options": {"normalize": False}})[0])
    expected = reference(dirs[CLIP], ITEMS, siglip=False)
    np.testing.assert_allclose(full, expected, rtol=1e-4, atol=1e-5)
    (cut,) = run(host, CLIP, {"items": ITEMS, "options": {"dimensions": 8}})
    assert cut.result["dims"] == 8
    np.testing.assert_allclose(vectors(cut), full[:, :8] / np.linalg.norm(
        full[:, :8], axis=1, keepdims=True), rtol=1e-4, atol=1e-6)
    (wide,) = run(host, CLIP, {"items": ITEMS, "options": {"dimensions": 17}})
    assert wide.error_code == "VALIDATION_ERROR" and "1 to 16" in wide.error_message
    (sparse,) = run(host, CLIP, {"items": ITEMS, "options": {"output": "sparse"}})
    assert sparse.error_code == "VALIDATION_ERROR" and "dense" in sparse.error_message


def test_prompts_go_before_texts_only(dirs):
    prompted = host_for(dirs, CLIP, prompts={"query": "query: ", "document": "doc: "},
                        normalize=False)
    items = ITEMS[:2]
    for is_query, prompt in ((True, "query: "), (False, "doc: ")):
        (outcome,) = run(prompted, CLIP, {"items": items, "options": {"is_query": is_query}})
        expected = reference(dirs[CLIP], items, siglip=False, prompt=prompt)
        np.testing.assert_allclose(vectors(outcome), expected, rtol=1e-4, atol=1e-5)


def test_bad_images_fail_alone(host):
    outcomes = run(
        host, CLIP,
        {"items": [{"text": "fine"}, {"image": PNG}]},
        {"items": [{"text": "x"}, {"image": b"not an image"}]},
        {"items": [{"image": PNG[: len(PNG) // 2]}]},  # truncated
        {"items": [{"image": image_bytes(fmt="BMP")}]},
        {"items": [{"image": png_header_only(7000, 7000)}]},  # over our 40 MP
        {"items": [{"image": png_header_only(20000, 20000)}]},  # over Pillow's own limit
        {"items": [{"image": image_bytes(size=(200, 2))}]},
        {"items": [{"image": ""}]},
        {"items": [{"image": PNG}]},
    )
    good, junk, cut, bmp, large, bomb, strip, empty, also_good = outcomes
    assert good.ok and also_good.ok
    assert (good.result["batch"]["requests"], good.result["batch"]["items"]) == (2, 3)
    assert all(o.error_code == "VALIDATION_ERROR" for o in outcomes[1:-1])
    assert junk.error_message.startswith("items[1].image could not be decoded as an image (")
    assert "send PNG, JPEG, WebP or GIF bytes" in junk.error_message
    assert "could not be decoded" in cut.error_message
    assert "could not be decoded" in bmp.error_message
    assert "7000x7000 pixels, over the limit of 40 megapixels" in large.error_message
    assert "more than the limit of 40 megapixels" in bomb.error_message
    assert "200x2 pixels, one side over 50 times the other" in strip.error_message
    assert "items[0].image is empty" in empty.error_message


@pytest.mark.parametrize("model", [CLIP, SIGLIP])
def test_truncate(host, dirs, model):
    long = {"text": "word " * 200}
    refused, cut = run(host, model,
                       {"items": [{"image": PNG}, long], "options": {"truncate": False}},
                       {"items": [{"image": PNG}, long]})
    assert refused.error_code == "INPUT_TOO_LONG"
    assert refused.error_message.startswith(f"items[1] has 202 tokens, over the model's "
                                            f"{MAX_TOKENS[model]}")
    expected = reference(dirs[model], [long], siglip=model == SIGLIP)
    assert cosines(vectors(cut)[1:], expected).min() >= 0.9999
    (short,) = run(host, model, {"items": [{"text": "short"}], "options": {"truncate": False}})
    assert short.ok


def test_wrong_dims_fail_at_load(dirs):
    with pytest.raises(ValueError, match="dims 32, but the model's vectors are 16 wide"):
        ModelHost().load([entry("test/wrong", dirs[CLIP], dims=32)])
