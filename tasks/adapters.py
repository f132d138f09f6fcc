"""What each adapter (model family) promises: its operation, inputs and outputs.

The catalog validates entries against these contracts and the gateway checks
requests with them, both without importing torch; the implementation named
here is imported only inside the runtime process.
"""

from __future__ import annotations

from dataclasses import dataclass

# Operations (one task name each, see tasks.names).
ENCODE = "encode"
SCORE = "score"
EXTRACT = "extract"
CLASSIFY = "classify"
GENERATE = "generate"

# Encode outputs.
DENSE = "dense"
SPARSE = "sparse"
MULTIVECTOR = "multivector"

TEXT = "text"
IMAGE = "image"


@dataclass(frozen=True, slots=True)
class AdapterContract:
    name: str
    operation: str
    inputs: frozenset[str]
    # For encode: the output kinds it produces (the first is the default).
    outputs: tuple[str, ...]
    # Whether the catalog entry must give `dims` (the width of its vectors).
    has_dims: bool
    implementation: str  # "module:Class", imported by the runtime only
    summary: str


def _contract(name: str, operation: str, implementation: str, summary: str, *,
              inputs: tuple[str, ...] = (TEXT,), outputs: tuple[str, ...] = (),
              has_dims: bool = False) -> AdapterContract:
    return AdapterContract(name, operation, frozenset(inputs), outputs, has_dims,
                           implementation, summary)


ADAPTERS: dict[str, AdapterContract] = {
    c.name: c
    for c in (
        _contract("dense", ENCODE, "runtimes.pytorch.dense:DenseAdapter",
                  "dense text embeddings (mean / CLS / last-token pooling)",
                  outputs=(DENSE,), has_dims=True),
        _contract("sparse", ENCODE, "runtimes.pytorch.sparse:SparseAdapter",
                  "SPLADE-style sparse embeddings over the vocabulary",
                  outputs=(SPARSE,)),
        _contract("multivector", ENCODE, "runtimes.pytorch.multivector:MultiVectorAdapter",
                  "ColBERT-style per-token embeddings", outputs=(MULTIVECTOR,), has_dims=True),
        _contract("clip", ENCODE, "runtimes.pytorch.clip:ClipAdapter",
                  "image and text embeddings in one space (CLIP, SigLIP)",
                  inputs=(TEXT, IMAGE), outputs=(DENSE,), has_dims=True),
        _contract("cross-encoder", SCORE, "runtimes.pytorch.cross_encoder:CrossEncoderAdapter",
                  "query-document relevance scores (rerankers)"),
        _contract("token-classification", EXTRACT,
                  "runtimes.pytorch.token_classification:TokenClassificationAdapter",
                  "named entities with character offsets (NER, PII)"),
        _contract("sequence-classification", CLASSIFY,
                  "runtimes.pytorch.sequence_classification:SequenceClassificationAdapter",
                  "labels from the model's own head (sentiment, topics, ...)"),
        _contract("zero-shot", CLASSIFY,
                  "runtimes.pytorch.sequence_classification:ZeroShotAdapter",
                  "caller-given labels scored by an NLI model"),
        _contract("causal-lm", GENERATE, "runtimes.pytorch.causal_lm:CausalLMAdapter",
                  "text generation (completions and chat)"),
        # Test only: crashes, raises or stalls on marker texts (runtimes.doubles.faulty).
        _contract("dense-faulty", ENCODE, "runtimes.doubles.faulty:FaultyDenseAdapter",
                  "test-only dense adapter that fails on purpose",
                  outputs=(DENSE,), has_dims=True),
        _contract("cross-encoder-faulty", SCORE,
                  "runtimes.doubles.faulty:FaultyCrossEncoderAdapter",
                  "test-only cross-encoder that fails on purpose"),
    )
}

OPERATIONS = (ENCODE, SCORE, EXTRACT, CLASSIFY, GENERATE)
