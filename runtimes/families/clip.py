"""Image and text embeddings in one space, whatever computes them: CLIP and SigLIP dual
encoders.

A request mixes text and image items in any order; each gets one vector from
its own tower, and because both towers project into the same space a text can
be compared with an image by cosine similarity (so vectors are normalised
unless the catalog or the caller says otherwise).

Images arrive as raw bytes: the gateway never decodes them, so `check`
decodes them here, refusing what is not an image, what is too large to decode
safely and what would blow up when resized. `run` then embeds every text of
the batch in a few padded chunks and every image in chunks of `IMAGE_CHUNK`.

The family's logic is here, once: decoding and checking images, tokenizing and the
length checks, the width and padding the model's config says, and the results. An
engine's subclass supplies the primitive (`ClipAdapter.load`, `_embed_texts`,
`_embed_images`): the towers, and their vectors (`runtimes.pytorch.clip`).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from io import BytesIO
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from runtimes.child_side.adapter import Adapter
from runtimes.families.text import max_length, too_long
from runtimes.families.vectors import dense_result
from tasks.catalog import ModelEntry
from tasks.errors import ShoalError
from tasks.schema import ParsedRequest, check_encode_output, invalid

# Decoded RGB takes 3 bytes a pixel: 40 MP is 120 MB, a generous photo.
MAX_IMAGE_PIXELS = 40_000_000
# CLIP resizes the shorter side up to its input size before cropping, so a
# 1 x 100000 strip would become a huge array; real photos and banners stay far below this.
MAX_ASPECT_RATIO = 50
# Only the common web formats: each extra Pillow decoder is more attack surface.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
IMAGE_CHUNK = 64  # images per pass


@dataclass(frozen=True, slots=True)
class ClipRequest:
    """A checked request: per item, its (truncated) token ids or its decoded image."""

    parsed: ParsedRequest
    inputs: list[list[int] | Image.Image]


def decode_image(data: bytes, index: int) -> Image.Image:
    """The RGB image in `data`, upright; VALIDATION_ERROR for bytes that are not one."""
    where = f"items[{index}].image"
    try:
        image = Image.open(BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise _too_large(where, None) from None
    except UnidentifiedImageError:
        # Pillow's own message names the BytesIO object, which tells the caller nothing.
        raise invalid(f"{where} could not be decoded as an image (not a format this model "
                      f"takes: {', '.join(IMAGE_FORMATS)}); send PNG, JPEG, WebP or GIF "
                      "bytes") from None
    except Exception as exc:  # any decoder failure is the caller's bytes, not our fault
        raise _undecodable(where, exc) from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise _too_large(where, (width, height))
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise invalid(f"{where} is {width}x{height} pixels, one side over {MAX_ASPECT_RATIO} "
                      "times the other; crop it to the part to embed")
    try:
        image.load()
        # Phones store photos sideways with an EXIF orientation; transformers'
        # load_image turns them upright too. In place: a copy of a large photo is costly.
        ImageOps.exif_transpose(image, in_place=True)
        return _rgb(image)
    except Exception as exc:
        raise _undecodable(where, exc) from None


def _rgb(image: Image.Image) -> Image.Image:
    # Transparent areas go on white, as the transformers processors do: dropping
    # the alpha channel would show whatever colour hides under it (often black).
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _undecodable(where: str, exc: Exception) -> ShoalError:
    reason = str(exc) or type(exc).__name__
    return invalid(f"{where} could not be decoded as an image ({reason}); send PNG, JPEG, "
                   "WebP or GIF bytes")


def _too_large(where: str, size: tuple[int, int] | None) -> ShoalError:
    limit = MAX_IMAGE_PIXELS // 1_000_000
    what = (f"is {size[0]}x{size[1]} pixels, over the limit of {limit} megapixels" if size
            else f"has more than the limit of {limit} megapixels")
    return invalid(f"{where} {what}; send a smaller image")


class ClipAdapter(Adapter):
    """Catalog `adapter: clip`: one vector per text or image item, text and image alike."""

    tokenizer: Any  # set by `load`, called as transformers' tokenizers are

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        config = self.load(ref)
        text_config = config.text_config
        # SigLIP has no projection: its vectors are as wide as the vision tower,
        # and its text head maps to that width.
        self.dims = int(getattr(config, "projection_dim", None)
                        or config.vision_config.hidden_size)
        if entry.dims != self.dims:
            raise ValueError(f"{entry.id}: the catalog says dims {entry.dims}, but the model's "
                             f"vectors are {self.dims} wide; set dims: {self.dims}")
        self.max_seq_length = max_length(self.tokenizer, text_config, entry.max_seq_length)
        # SigLIP pools the last position and was trained on texts padded to its full
        # length, so it must see them padded the same way; CLIP pools the end-of-text
        # token behind a causal mask, so padding to the longest text is enough.
        self.pad_to: int | None = None
        if "siglip" in config.model_type:
            self.pad_to = int(text_config.max_position_embeddings)
        self.normalize = entry.normalize is not False

    @abstractmethod
    def load(self, ref: str) -> Any:
        """Set `tokenizer` and load both towers and the image processor of the model in
        `ref`: its config as transformers' (model_type, text_config, vision_config,
        projection_dim)."""

    @abstractmethod
    def _embed_texts(self, ids: list[list[int]]) -> np.ndarray:
        """(len(ids), dims) float32 text vectors (padded to `pad_to` where it is set)."""

    @abstractmethod
    def _embed_images(self, images: list[Image.Image]) -> np.ndarray:
        """(len(images), dims) float32 image vectors, `IMAGE_CHUNK` images a pass."""

    def _texts(self, parsed: ParsedRequest) -> list[str]:
        prompt = self.prompt(parsed)
        return [prompt + (item.text or "") for item in parsed.items if item.image is None]

    def _tokenize(self, parsed: ParsedRequest) -> list[list[int]]:
        texts = self._texts(parsed)
        if not texts:
            return []
        truncate = parsed.options.truncate
        encoded = self.tokenizer(
            texts, truncation=truncate, max_length=self.max_seq_length if truncate else None,
            padding=False, return_attention_mask=False, return_token_type_ids=False,
        )
        ids: list[list[int]] = encoded["input_ids"]
        if not truncate:
            text_items = [i for i, item in enumerate(parsed.items) if item.image is None]
            for index, row in zip(text_items, ids, strict=True):
                if len(row) > self.max_seq_length:
                    raise too_long(index, len(row), self.max_seq_length)
        return ids

    def check(self, parsed: ParsedRequest) -> ClipRequest:
        if self.dims != self.entry.dims:  # else the entry's parse checked it all already
            check_encode_output(parsed.options, self.entry.id, "dense", self.dims)
        tokens = iter(self._tokenize(parsed))
        inputs: list[list[int] | Image.Image] = [
            next(tokens) if item.image is None else decode_image(item.image, i)
            for i, item in enumerate(parsed.items)
        ]
        return ClipRequest(parsed, inputs)

    def run(self, prepared: list[ClipRequest]) -> list[dict[str, Any]]:
        texts: list[tuple[int, int, list[int]]] = []
        images: list[tuple[int, int, Image.Image]] = []
        for r, request in enumerate(prepared):
            for i, value in enumerate(request.inputs):
                if isinstance(value, Image.Image):
                    images.append((r, i, value))
                else:
                    texts.append((r, i, value))
        rows = [np.empty((len(request.inputs), self.dims), dtype=np.float32)
                for request in prepared]
        used = [0] * len(prepared)
        if texts:
            vectors = self._embed_texts([ids for _, _, ids in texts])
            for (r, i, ids), vector in zip(texts, vectors, strict=True):
                rows[r][i] = vector
                used[r] += len(ids)
        if images:
            vectors = self._embed_images([image for _, _, image in images])
            for (r, i, _), vector in zip(images, vectors, strict=True):
                rows[r][i] = vector
                used[r] += self.entry.image_tokens
        return [dense_result(rows[r], request.parsed.options, self.normalize, used[r])
                for r, request in enumerate(prepared)]
