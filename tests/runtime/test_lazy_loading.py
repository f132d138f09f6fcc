"""Loading and unloading models in a running runtime process, beside its batches.

Tiny models saved at test time; the runtime starts with only one of them
(`test/tiny`, as if pinned) and loads the others on demand.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModel

from runtimes.base import LoadFailed, Request
from runtimes.model_files.footprint import estimate_bytes, tensor_bytes
from runtimes.worker_side.process import ProcessRuntime
from tests.slow_batches import SlowBatches
from tests.tiny_models import build_tiny_bert, build_tiny_sentence_transformer

TINY, OTHER, BIG, BROKEN, SLOW = "test/tiny", "test/other", "test/big", "test/broken", "test/slow"
SLOW_BATCHES = SlowBatches(Path(tempfile.mkdtemp(prefix="shoal-lazy-slow-")), slow_s=0.0)
CHILD_ENV = SLOW_BATCHES.env


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lazy")
    broken = root / "broken"
    broken.mkdir()
    # A model folder whose weights are not weights: the load fails, the runtime survives.
    build_tiny_bert(broken, seed=3)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file" * 100)
    return {
        TINY: build_tiny_sentence_transformer(root / "tiny", pooling="mean", normalize=True),
        OTHER: build_tiny_sentence_transformer(root / "other", pooling="cls", normalize=False,
                                               seed=1),
        BIG: build_tiny_bert(root / "big", seed=2, hidden=128, layers=4),
        BROKEN: broken,
    }


@pytest.fixture(scope="module")
def catalog_dir(weights: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("lazy-catalog")
    for i, (model_id, path) in enumerate(weights.items()):
        dims = 128 if model_id == BIG else 32
        entry = {"id": model_id, "adapter": "dense", "source": {"path": str(path)}, "dims": dims}
        (directory / f"m{i}.yaml").write_text(yaml.safe_dump(entry))
    slow = {"id": SLOW, "adapter": "dense-faulty", "source": {"path": str(weights[TINY])},
            "dims": 32}
    (directory / "slow.yaml").write_text(yaml.safe_dump(slow))
    return directory


@pytest.fixture()
def runtime(catalog_dir: Path):
    with ProcessRuntime(catalog_dir, [TINY], threads=1, start_timeout=60,
                        env=CHILD_ENV) as runtime:
        yield runtime


def _encode(runtime: ProcessRuntime, model: str, text: str = "hello") -> object:
    (outcome,) = runtime.run_batch(model, [Request("r", "encode", {"items": [{"text": text}]})])
    return outcome


def test_the_runtime_starts_with_its_start_up_models_and_reports_their_bytes(runtime):
    assert set(runtime.resident) == {TINY} and runtime.resident[TINY] > 0
    assert runtime.device_bytes and runtime.device_bytes > runtime.resident[TINY]
    assert _encode(runtime, OTHER).error_code == "MODEL_NOT_FOUND"  # not loaded yet


def test_a_load_serves_the_model_and_its_footprint_is_its_tensors(runtime, weights):
    measured = runtime.load(BIG)
    model = AutoModel.from_pretrained(str(weights[BIG]))
    tensors = sum(t.numel() * t.element_size()
                  for t in (*model.parameters(), *model.buffers()))
    assert abs(measured - tensors) <= 0.1 * tensors
    assert abs(tensor_bytes(model) - tensors) <= 0.1 * tensors
    # The estimate from the weight files is close too (fp32 saved, fp32 loaded).
    assert abs(estimate_bytes(weights[BIG]) - tensors) <= 0.1 * tensors
    assert _encode(runtime, BIG).ok and runtime.resident[BIG] == measured


def test_an_unloaded_model_is_gone_and_the_others_still_serve(runtime):
    runtime.load(OTHER)
    runtime.unload(OTHER)
    assert OTHER not in runtime.resident
    assert _encode(runtime, OTHER).error_code == "MODEL_NOT_FOUND"
    assert _encode(runtime, TINY).ok


def test_a_load_that_fails_says_why_and_the_runtime_keeps_serving(runtime):
    pid = runtime.pid
    with pytest.raises(LoadFailed, match=r"safetensors|header|Error"):
        runtime.load(BROKEN)
    assert runtime.pid == pid and BROKEN not in runtime.resident
    assert _encode(runtime, TINY).ok


def test_a_load_runs_beside_a_batch_of_another_model(runtime):
    runtime.load(SLOW)
    batch_done = threading.Event()
    outcome: list[object] = []

    def slow_batch() -> None:
        outcome.append(_encode(runtime, SLOW, "@@slow@@"))  # held in the model till released
        batch_done.set()

    started = SLOW_BATCHES.started()
    SLOW_BATCHES.hold()
    thread = threading.Thread(target=slow_batch)
    thread.start()
    try:
        SLOW_BATCHES.wait_started(started + 1)
        runtime.load(OTHER)
        # The load returned while the batch was still held in the model: it did not
        # wait for the batch.
        assert not batch_done.is_set()
    finally:
        SLOW_BATCHES.release()
        thread.join(timeout=60)
    assert outcome and outcome[0].ok and _encode(runtime, OTHER).ok


def test_a_child_that_replaces_a_dead_one_reloads_what_was_resident(runtime):
    runtime.load(OTHER)
    old = runtime.pid
    os.kill(old, signal.SIGKILL)
    assert _encode(runtime, OTHER).ok  # the batch path respawns it, with OTHER loaded
    assert runtime.pid != old and set(runtime.resident) >= {TINY, OTHER}


def test_a_runtime_with_nothing_pinned_loads_its_first_model_at_once(catalog_dir):
    # It imports transformers in the background once ready; a load that came meanwhile
    # used to race that import and fail ("cannot import name 'AutoModel'").
    with ProcessRuntime(catalog_dir, [], threads=1, start_timeout=60, env=CHILD_ENV) as rt:
        assert rt.resident == {}
        assert rt.load(OTHER) > 0
        assert _encode(rt, OTHER).ok


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_footprint_counts_the_allocator(catalog_dir):
    with ProcessRuntime(catalog_dir, [], device="cuda", start_timeout=120) as runtime:
        assert runtime.load(BIG) > 0
