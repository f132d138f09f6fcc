"""SPLADE sparse embeddings on ONNX Runtime: the graph's masked-LM logits, pooled into
term weights here (`runtimes.families.splade`, as `runtimes.pytorch.sparse` does with torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtimes.families.splade import (
    LOGITS_BUDGET,
    check_sparse_request,
    check_vocabulary,
    nonzero_terms,
    read_splade_config,
    sparse_results,
    splade_weights,
)
from runtimes.families.st_config import read_st_config
from runtimes.model_files.files import encoder_ref
from runtimes.onnx.adapter import OnnxAdapter
from tasks.catalog import ModelEntry
from tasks.schema import ParsedRequest


class OnnxSparseAdapter(OnnxAdapter):
    """Catalog `adapter: sparse` on ONNX Runtime."""

    family = "sparse"

    def __init__(self, entry: ModelEntry, ref: str, **kwargs: Any) -> None:
        super().__init__(entry, ref, **kwargs)
        self.splade = read_splade_config(ref)
        folder = encoder_ref(ref, self.splade.encoder_dir)
        st = read_st_config(Path(folder))
        self.model = self.open_model(folder, entry.max_seq_length, st.max_seq_length)
        self.tokenizer = self.model.tokenizer
        self.do_lower_case = st.do_lower_case
        self.vocab_size = int(self.model.config.vocab_size)
        check_vocabulary(entry, self.vocab_size)
        self.forward_tokens = max(1, min(self.chunk_tokens, LOGITS_BUDGET // self.vocab_size))

    def _texts(self, parsed: ParsedRequest) -> list[str]:
        return self.prompted(parsed, self.do_lower_case)

    def check(self, parsed: ParsedRequest) -> ParsedRequest:
        check_sparse_request(parsed, self.entry, self.tokenizer, self._texts(parsed),
                             self.model.max_length)
        return parsed

    def run(self, prepared: list[ParsedRequest]) -> list[dict[str, Any]]:
        texts = [t for parsed in prepared for t in self._texts(parsed)]
        encoded = self.tokenizer(texts, truncation=True, max_length=self.model.max_length)
        input_ids = encoded["input_ids"]
        vectors: list[dict[str, list]] = [{}] * len(input_ids)
        for chunk, inputs in self.model.chunks(input_ids, encoded.get("token_type_ids"),
                                               self.forward_tokens):
            logits = self.model.run(inputs)
            weights = splade_weights(logits, inputs["attention_mask"], self.splade)
            for row, i in zip(weights, chunk, strict=True):
                vectors[i] = nonzero_terms(row)
        return sparse_results(prepared, vectors, input_ids, self.vocab_size)
