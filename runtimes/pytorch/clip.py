"""Image and text embeddings on PyTorch: the CLIP family's primitive
(`runtimes.families.clip`), both towers and the image processor (transformers')."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import AutoImageProcessor, AutoModel

from runtimes.families import clip
from runtimes.families.clip import IMAGE_CHUNK
from runtimes.model_files.precision import torch_dtype
from runtimes.pytorch.loading import load_model
from runtimes.pytorch.text import length_chunks

TEXT_INPUTS = ("input_ids", "attention_mask")


def _pooled(output: Any) -> torch.Tensor:
    # get_*_features return the tensor in transformers 4 and an output whose
    # pooler_output is the projected vector in transformers 5.
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _pil_processor_kwargs() -> dict[str, Any]:
    # The PIL processors are the reference CLIP preprocessing (and need no torchvision);
    # transformers 5 selects them with `backend`, 4 with `use_fast`.
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"backend": "pil"}
    return {"use_fast": False}


class ClipAdapter(clip.ClipAdapter):
    """Catalog `adapter: clip` on PyTorch."""

    def load(self, ref: str) -> Any:
        # No pad id kept: texts are padded by the tokenizer itself (SigLIP to full length).
        self.tokenizer, self.model, _ = load_model(AutoModel, ref, self.device,
                                                   torch_dtype(self.precision))
        self.processor = AutoImageProcessor.from_pretrained(ref, local_files_only=True,
                                                            **_pil_processor_kwargs())
        return self.model.config

    @torch.inference_mode()
    def _embed_texts(self, ids: list[list[int]]) -> np.ndarray:
        out = np.empty((len(ids), self.dims), dtype=np.float32)
        lengths = [self.pad_to or len(row) for row in ids]
        for chunk in length_chunks(lengths, self.chunk_tokens):
            padded = self.tokenizer.pad(
                {"input_ids": [ids[i] for i in chunk]},
                padding="max_length" if self.pad_to else "longest",
                max_length=self.pad_to, return_tensors="pt",
            )
            inputs = {k: padded[k].to(self.device) for k in TEXT_INPUTS if k in padded}
            vectors = _pooled(self.model.get_text_features(**inputs))
            out[chunk] = vectors.float().cpu().numpy()
        return out

    @torch.inference_mode()
    def _embed_images(self, images: list[Image.Image]) -> np.ndarray:
        out = np.empty((len(images), self.dims), dtype=np.float32)
        for start in range(0, len(images), IMAGE_CHUNK):
            processed = self.processor(images=images[start : start + IMAGE_CHUNK],
                                       return_tensors="pt")
            inputs = {
                k: v.to(self.device, self.model.dtype) if v.is_floating_point()
                else v.to(self.device)
                for k, v in processed.items()
            }
            vectors = _pooled(self.model.get_image_features(**inputs))
            out[start : start + IMAGE_CHUNK] = vectors.float().cpu().numpy()
        return out
