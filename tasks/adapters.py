"""What each adapter (model family) promises: its operation, inputs and outputs.

The catalog validates entries against these contracts and the gateway checks
requests with them, both without importing torch. A family's logic is written once, in
`runtimes/families/` (its checks, tokenizing, pooling, results), over a primitive that
each engine that serves it supplies; which class computes a family is its engine's
(`runtimes.pytorch.families`, `runtimes.onnx.engine.ADAPTERS`; `tasks.engines` says which
engine serves which families). A test or a plugin adds a family with `register`.
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
    summary: str


def _contract(name: str, operation: str, summary: str, *,
              inputs: tuple[str, ...] = (TEXT,), outputs: tuple[str, ...] = (),
              has_dims: bool = False) -> AdapterContract:
    return AdapterContract(name, operation, frozenset(inputs), outputs, has_dims, summary)


ADAPTERS: dict[str, AdapterContract] = {
    c.name: c
    for c in (
        _contract("dense", ENCODE, "dense text embeddings (mean / CLS / last-token pooling)",
                  outputs=(DENSE,), has_dims=True),
        _contract("sparse", ENCODE, "SPLADE-style sparse embeddings over the vocabulary",
                  outputs=(SPARSE,)),
        _contract("multivector", ENCODE, "ColBERT-style per-token embeddings",
                  outputs=(MULTIVECTOR,), has_dims=True),
        _contract("clip", ENCODE, "image and text embeddings in one space (CLIP, SigLIP)",
                  inputs=(TEXT, IMAGE), outputs=(DENSE,), has_dims=True),
        _contract("cross-encoder", SCORE, "query-document relevance scores (rerankers)"),
        _contract("token-classification", EXTRACT,
                  "named entities with character offsets (NER, PII)"),
        _contract("sequence-classification", CLASSIFY,
                  "labels from the model's own head (sentiment, topics, ...)"),
        _contract("zero-shot", CLASSIFY, "caller-given labels scored by an NLI model"),
        _contract("causal-lm", GENERATE, "text generation (completions and chat)"),
        # Test only: crash, raise or stall on marker texts (PyTorch's map names the
        # classes, in runtimes.doubles.faulty).
        _contract("dense-faulty", ENCODE, "test-only dense adapter that fails on purpose",
                  outputs=(DENSE,), has_dims=True),
        _contract("cross-encoder-faulty", SCORE,
                  "test-only cross-encoder that fails on purpose"),
    )
}

OPERATIONS = (ENCODE, SCORE, EXTRACT, CLASSIFY, GENERATE)


def register(contract: AdapterContract) -> None:
    """Add a family at run time (a test's, a plugin's): the catalog and the gateway read
    it from then on, in this process. A name taken is an error."""
    if contract.name in ADAPTERS:
        raise ValueError(f"an adapter named {contract.name!r} is registered already")
    if contract.operation not in OPERATIONS:
        raise ValueError(f"adapter {contract.name!r}: unknown operation "
                         f"{contract.operation!r}; allowed: {list(OPERATIONS)}")
    ADAPTERS[contract.name] = contract


def unregister(name: str) -> None:
    ADAPTERS.pop(name, None)
