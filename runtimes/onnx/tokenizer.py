"""A model folder's fast tokenizer without transformers: its `tokenizer.json` read by the
`tokenizers` library, called as the shared adapters call transformers' tokenizers.

Importing transformers costs the ONNX runtime a second or more of its cold start (and
would pull torch in where it is installed), and a fast tokenizer is all that file
needs: its normalizer, pre-tokenizer, model and post-processor (special tokens, pair
layout) are in it. `tokenizer_config.json` adds what transformers keeps beside it:
the length limit, the truncation side and the names of the special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Encoding, Tokenizer

from runtimes.families.text import encoding_lock

# Tokenizers without a limit report a huge sentinel, as transformers' do.
NO_LIMIT = int(1e30)


class FileTokenizer:
    """The subset of transformers' fast-tokenizer calls the adapters make."""

    is_fast = True

    def __init__(self, folder: str | Path, takes_token_types: bool) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no tokenizer.json: the ONNX runtime reads fast "
                             "tokenizers only (save the tokenizer with transformers' "
                             "save_pretrained to write one)")
        self.backend_tokenizer = Tokenizer.from_file(str(path))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.model_max_length = int(config.get("model_max_length") or NO_LIMIT)
        self.truncation_side = config.get("truncation_side", "right")
        self.model_input_names = ["input_ids", "attention_mask"]
        if takes_token_types:
            self.model_input_names.insert(1, "token_type_ids")
        self.pad_token_id = self._special_id(config, "pad_token")
        self.unk_token_id = self._special_id(config, "unk_token")

    def _special_id(self, config: dict[str, Any], name: str) -> int | None:
        token = config.get(name)
        if isinstance(token, dict):  # an AddedToken saved as its fields
            token = token.get("content")
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    def __call__(self, first: list[str], second: list[str] | None = None, *,
                 truncation: bool | str = False, max_length: int | None = None,
                 padding: bool = False, return_offsets_mapping: bool = False,
                 return_special_tokens_mask: bool = False) -> dict[str, list]:
        if padding:
            raise ValueError("FileTokenizer does not pad; the runtime pads per chunk")
        inputs: list[Any] = first if second is None else list(zip(first, second, strict=True))
        encodings = self._encode(inputs, truncation, max_length)
        out: dict[str, list] = {"input_ids": [e.ids for e in encodings]}
        if "token_type_ids" in self.model_input_names:
            out["token_type_ids"] = [e.type_ids for e in encodings]
        if return_offsets_mapping:
            out["offset_mapping"] = [e.offsets for e in encodings]
        if return_special_tokens_mask:
            out["special_tokens_mask"] = [e.special_tokens_mask for e in encodings]
        return out

    def _encode(self, inputs: list[Any], truncation: bool | str,
                max_length: int | None) -> list[Encoding]:
        backend = self.backend_tokenizer
        with encoding_lock:  # truncation is state of the shared backend
            if truncation:
                strategy = "longest_first" if truncation is True else truncation
                limit = max_length or self.model_max_length
                backend.enable_truncation(limit, strategy=strategy,
                                          direction=self.truncation_side)
            else:
                backend.no_truncation()
            backend.no_padding()
            return backend.encode_batch(inputs)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(i) for i in ids]
