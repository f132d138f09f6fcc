"""The health probe: every adapter's own small request is answered by a real runtime.

After a failure the process runtime blames a lone request only if the model's
probe is answered (runtimes.worker_side.process). A probe the adapter refuses would hide
every poison request behind RuntimeUnhealthy, and one that is refused but
read as healthy would blame innocent requests, so each adapter's probe is
run here in a real runtime process on a tiny model of its family.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runtimes.base import Request
from runtimes.pytorch.adapter import probe_kwargs
from runtimes.worker_side.process import ProcessRuntime
from tasks.adapters import ADAPTERS, ENCODE, IMAGE, OPERATIONS
from tests.tiny_classifiers import (
    build_tiny_cross_encoder,
    build_tiny_ner,
    build_tiny_nli,
    build_tiny_sentiment,
    serve,
)
from tests.tiny_clip import PROJECTION_DIM, build_tiny_clip
from tests.tiny_encoders import build_tiny_colbert_st, build_tiny_splade
from tests.tiny_lm import build_tiny_llama
from tests.tiny_models import build_tiny_sentence_transformer

# adapter: (builder, extra catalog fields)
FAMILIES = {
    "dense": (lambda out: build_tiny_sentence_transformer(out, "mean", normalize=True),
              {"dims": 32}),
    "sparse": (build_tiny_splade, {}),
    "multivector": (build_tiny_colbert_st, {"dims": 16}),
    "clip": (build_tiny_clip, {"dims": PROJECTION_DIM}),
    "cross-encoder": (build_tiny_cross_encoder, {}),
    "token-classification": (build_tiny_ner, {}),
    "sequence-classification": (build_tiny_sentiment, {}),
    "zero-shot": (build_tiny_nli, {}),
    "causal-lm": (build_tiny_llama, {}),
}


def model_id(adapter: str) -> str:
    return f"test/probe-{adapter}"


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("probe-weights")
    return {adapter: build(root / adapter) for adapter, (build, _) in FAMILIES.items()}


@pytest.fixture(scope="module")
def runtime(weights: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    catalog = tmp_path_factory.mktemp("probe-catalog")
    for adapter, (_, extra) in FAMILIES.items():
        entry = {"id": model_id(adapter), "adapter": adapter,
                 "source": {"path": str(weights[adapter])}, **extra}
        (catalog / f"{adapter}.yaml").write_text(yaml.safe_dump(entry))
    with ProcessRuntime(catalog, [model_id(a) for a in FAMILIES], threads=1,
                        start_timeout=120) as runtime:
        yield runtime


def test_every_served_adapter_and_operation_is_covered():
    served = {name for name in ADAPTERS if "faulty" not in name}  # the test-only ones aside
    assert set(FAMILIES) == served
    assert {ADAPTERS[name].operation for name in FAMILIES} == set(OPERATIONS)


@pytest.mark.parametrize("adapter", list(FAMILIES))
def test_the_probe_is_answered(runtime, adapter):
    assert runtime.probe(model_id(adapter)) is None
    assert runtime.restarts == 0 and runtime.poison_isolated == 0


def test_an_image_probe_is_answered(weights):
    """Models that take images only would be probed with an image; CLIP takes one too."""
    host = serve("test/probe-image", "clip", weights["clip"], dims=PROJECTION_DIM)
    kwargs = probe_kwargs(ENCODE, frozenset({IMAGE}))
    assert "image" in kwargs["items"][0]
    (outcome,) = host.run_batch("test/probe-image", [Request("p", ENCODE, kwargs)])
    assert outcome.ok, outcome.error_message
