"""PyTorch's adapter class for each model family, "module:Class", imported when an entry of
the family loads (`runtimes.pytorch.engine.TorchEngine.adapter_class`; a spare imports the
catalog's ahead). Plain strings: importing this imports no torch.

Every family of the contract (`tasks.adapters.ADAPTERS`) has one: PyTorch is the engine
that serves them all (`tasks.engines`).
"""

from __future__ import annotations

ADAPTERS: dict[str, str] = {
    "dense": "runtimes.pytorch.dense:DenseAdapter",
    "sparse": "runtimes.pytorch.sparse:SparseAdapter",
    "multivector": "runtimes.pytorch.multivector:MultiVectorAdapter",
    "clip": "runtimes.pytorch.clip:ClipAdapter",
    "cross-encoder": "runtimes.pytorch.cross_encoder:CrossEncoderAdapter",
    "token-classification":
        "runtimes.pytorch.token_classification:TokenClassificationAdapter",
    "sequence-classification":
        "runtimes.pytorch.sequence_classification:SequenceClassificationAdapter",
    "zero-shot": "runtimes.pytorch.sequence_classification:ZeroShotAdapter",
    "causal-lm": "runtimes.pytorch.causal_lm:CausalLMAdapter",
    # Test only: fail on purpose on marker texts. A string, not an import: production code
    # never imports the doubles.
    "dense-faulty": "runtimes.doubles.faulty:FaultyDenseAdapter",
    "cross-encoder-faulty": "runtimes.doubles.faulty:FaultyCrossEncoderAdapter",
}
