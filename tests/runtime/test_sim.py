"""The simulated runtime: real checks, a device's latency, results of the right shape.

No weights: the entries point at a hub id the sim never loads.
"""

from __future__ import annotations

import base64
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from batching.latency_model import BatchShape
from runtimes.base import Outcome, Request, RuntimeClosed
from runtimes.doubles.sim import DEVICE_KINDS, SimRuntime, sim_constants
from tasks.catalog import BatchProfile, ModelEntry
from tasks.errors import ErrorCode
from tasks.results import embedding_rows, multivector_rows, row_width
from tasks.settings import Settings
from tasks.token_estimate import estimate_request

REPO = Path(__file__).resolve().parents[2]
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)


def entry(model: str, adapter: str, **fields) -> ModelEntry:
    return ModelEntry.model_validate({"id": model, "adapter": adapter,
                                      "source": {"hub": "x/y"}, **fields})


DENSE = entry("t/dense", "dense", dims=16, max_seq_length=64,
              profiles={"cpu": {"cost_a_ms": 2, "cost_b_us": 50, "cost_c_ns": 10}})
SPARSE = entry("t/sparse", "sparse")
COLBERT = entry("t/colbert", "multivector", dims=8)
CLIP = entry("t/clip", "clip", dims=12, image_tokens=17)
RERANKER = entry("t/reranker", "cross-encoder")
NER = entry("t/ner", "token-classification")
SENTIMENT = entry("t/sentiment", "sequence-classification")
NLI = entry("t/nli", "zero-shot")
LLM = entry("t/llm", "causal-lm", defaults={"max_tokens": 5})
ALL = [DENSE, SPARSE, COLBERT, CLIP, RERANKER, NER, SENTIMENT, NLI, LLM]
FAST = (0.0, 0.0, 0.0)  # no sleep: shape tests need no time


@pytest.fixture(scope="module")
def sim() -> SimRuntime:
    return SimRuntime(ALL, "cpu", constants=FAST)


def run_one(sim: SimRuntime, model: ModelEntry, kwargs: dict, op: str | None = None):
    (outcome,) = sim.run_batch(model.id, [Request("r", op or model.operation, kwargs)])
    return outcome


def texts(*values: str) -> list[dict]:
    return [{"text": v} for v in values]


# --- outputs per operation ------------------------------------------------------------------


def test_dense_vectors_are_unit_deterministic_and_per_item(sim):
    out = run_one(sim, DENSE, {"items": texts("a cat", "a dog", "a cat")})
    assert out.ok, out.error_message
    r = out.result
    assert (r["output"], r["dims"], r["count"], r["dtype"]) == ("dense", 16, 3, "float32")
    rows = np.array(embedding_rows(r))
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(rows[0], rows[2])
    assert not np.allclose(rows[0], rows[1])
    again = run_one(sim, DENSE, {"items": texts("a cat")}).result
    np.testing.assert_array_equal(np.array(embedding_rows(again))[0], rows[0])
    assert r["usage"]["tokens"] == estimate_request("encode", {"items": texts("a cat", "a dog",
                                                                              "a cat")}, 64)[1]


def test_dense_honours_dimensions_dtype_and_normalize(sim):
    r = run_one(sim, DENSE, {"items": texts("x", "y"), "options": {"dimensions": 4}}).result
    rows = np.array(embedding_rows(r))
    assert rows.shape == (2, 4)
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
    raw = run_one(sim, DENSE, {"items": texts("x"), "options": {"normalize": False}}).result
    assert abs(np.linalg.norm(embedding_rows(raw)[0]) - 1.0) > 1e-3
    for dtype in ("float16", "int8", "binary"):
        r = run_one(sim, DENSE, {"items": texts("x", "y"), "options": {"dtype": dtype}}).result
        assert r["dtype"] == dtype
        assert len(embedding_rows(r)) == 2 and len(embedding_rows(r)[0]) == row_width(16, dtype)


def test_sparse_gives_a_few_sorted_terms(sim):
    r = run_one(sim, SPARSE, {"items": texts("hello there", "x" * 400)}).result
    assert r["output"] == "sparse" and r["count"] == 2 and r["vocab_size"] > 0
    for vector in r["embeddings"]:
        assert 0 < len(vector["indices"]) == len(vector["values"]) <= 8
        assert vector["indices"] == sorted(set(vector["indices"]))
        assert all(0 <= i < r["vocab_size"] for i in vector["indices"])
        assert all(v > 0 for v in vector["values"])


def test_multivector_has_one_unit_vector_per_estimated_token(sim):
    items = texts("short", "a longer text of several words " * 3)
    r = run_one(sim, COLBERT, {"items": items}).result
    assert (r["output"], r["dims"], r["count"], r["dtype"]) == ("multivector", 8, 2, "float32")
    assert r["lengths"] == [estimate_request("encode", {"items": [i]}, 512)[1] for i in items]
    rows = multivector_rows(r)
    assert [len(v) for v in rows] == r["lengths"]
    np.testing.assert_allclose(np.linalg.norm(np.array(rows[0]), axis=1), 1.0, atol=1e-5)


def test_clip_embeds_images_and_texts(sim):
    r = run_one(sim, CLIP, {"items": [{"image": PNG}, {"text": "a photo"}]}).result
    assert r["dims"] == 12 and r["count"] == 2
    assert r["usage"]["tokens"] == 17 + estimate_request("encode", {"items": texts("a photo")},
                                                         512)[1]


def test_score_extract_classify_shapes(sim):
    score = run_one(sim, RERANKER, {"query": "q", "items": texts("a", "b", "c")}).result
    assert len(score["scores"]) == 3 and all(0 <= s <= 1 for s in score["scores"])
    extract = run_one(sim, NER, {"items": texts("Ada in London", "x")}).result
    assert extract["entities"] == [[], []]
    fixed = run_one(sim, SENTIMENT, {"items": texts("good", "bad")}).result
    assert [sorted(x["label"] for x in row) for row in fixed["labels"]] == [
        ["LABEL_0", "LABEL_1"]] * 2
    assert all(abs(sum(x["score"] for x in row) - 1) < 1e-6 for row in fixed["labels"])
    shot = run_one(sim, NLI, {"items": texts("goal!"),
                              "options": {"labels": ["sports", "music", "news"], "top_k": 2}})
    rows = shot.result["labels"]
    assert len(rows) == 1 and len(rows[0]) == 2
    assert {x["label"] for x in rows[0]} <= {"sports", "music", "news"}
    assert rows[0][0]["score"] >= rows[0][1]["score"]


def test_generate_fills_max_tokens_words(sim):
    items = [{"text": "Once upon"}, {"messages": [{"role": "user", "content": "hi"}]}]
    r = run_one(sim, LLM, {"items": items, "options": {"max_tokens": 7}}).result
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for choice in r["choices"]:
        assert len(choice["text"].split()) == 7
        assert choice["finish_reason"] == "length" and choice["completion_tokens"] == 7
    usage = r["usage"]
    assert usage["completion_tokens"] == 14
    assert usage["tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["tokens"] == estimate_request("generate", {"items": items,
                                                            "options": {"max_tokens": 7}}, 512)[1]
    default = run_one(sim, LLM, {"items": texts("hi")}).result  # the entry's default: 5
    assert len(default["choices"][0]["text"].split()) == 5


def test_token_id_items_where_the_real_runtimes_take_them(sim):
    ids = [{"tokens": [101, 7592, 102]}, {"tokens": [101, 7592, 102]}, {"tokens": [101, 5]}]
    out = run_one(sim, DENSE, {"items": ids})
    assert out.ok, out.error_message
    rows = np.array(embedding_rows(out.result))
    np.testing.assert_array_equal(rows[0], rows[1])
    assert not np.allclose(rows[0], rows[2])
    assert out.result["usage"]["tokens"] == 3 + 3 + 2
    generated = run_one(sim, LLM, {"items": [{"tokens": [1, 2, 3]}],
                                   "options": {"max_tokens": 4}})
    assert generated.ok and generated.result["choices"][0]["prompt_tokens"] == 3
    refused = run_one(sim, SPARSE, {"items": [{"tokens": [1]}]})
    assert refused.error_code == "VALIDATION_ERROR"
    assert "token-id input is for dense embeddings and completions" in refused.error_message


def test_every_result_says_it_is_simulated(sim):
    for model in ALL:
        kwargs = {"items": texts("hello")}
        if model is RERANKER:
            kwargs["query"] = "q"
        if model is NLI:
            kwargs["options"] = {"labels": ["a", "b"]}
        out = run_one(sim, model, kwargs)
        assert out.ok, (model.id, out.error_message)
        assert out.result["simulated"] == {"device": "cpu", "a_ms": 0.0, "b_us": 0.0,
                                           "c_ns": 0.0, "speed": 1.0}
        assert out.result["model"] == model.id
        assert out.result["usage"]["tokens"] > 0
        # The simulated device's busy time is what it slept: none at zero cost.
        assert set(out.result["batch"]) == {"requests", "items", "inference_ms", "device_ms"}
        assert out.result["batch"]["device_ms"] == 0.0


# --- checks ---------------------------------------------------------------------------------


def test_a_bad_request_fails_alone(sim):
    requests = [
        Request("ok", "encode", {"items": texts("fine")}),
        Request("dims", "encode", {"items": texts("x"), "options": {"dimensions": 17}}),
        Request("option", "encode", {"items": texts("x"), "options": {"bogus": 1}}),
        Request("empty", "encode", {"items": []}),
        Request("image", "encode", {"items": [{"image": PNG}]}),
        Request("output", "encode", {"items": texts("x"), "options": {"output": "sparse"}}),
        Request("op", "score", {"query": "q", "items": texts("x")}),
        Request("ok2", "encode", {"items": texts("also fine", "and this")}),
    ]
    out = {o.id: o for o in sim.run_batch(DENSE.id, requests)}
    assert [o.id for o in sim.run_batch(DENSE.id, requests)] == [r.id for r in requests]
    assert out["ok"].ok and out["ok2"].ok
    assert out["ok2"].result["batch"]["requests"] == 2
    assert out["ok2"].result["batch"]["items"] == 3
    for bad in ("dims", "option", "empty", "image", "output"):
        assert out[bad].error_code == ErrorCode.VALIDATION_ERROR, bad
    assert "1 to 16" in out["dims"].error_message
    assert out["op"].error_code == ErrorCode.UNSUPPORTED_OPERATION
    assert "serves 'encode', not 'score'" in out["op"].error_message


@pytest.mark.parametrize(("model", "kwargs"), [
    (SPARSE, {"items": texts("x"), "options": {"dtype": "int8"}}),
    (SPARSE, {"items": texts("x"), "options": {"dimensions": 4}}),
    (COLBERT, {"items": texts("x"), "options": {"normalize": False}}),
    (RERANKER, {"items": texts("x")}),  # no query
    (SENTIMENT, {"items": texts("x"), "options": {"labels": ["a"]}}),
    (NLI, {"items": texts("x")}),  # no labels
    (LLM, {"items": texts("x"), "options": {"max_tokens": 0}}),
])
def test_adapter_checks_like_the_real_runtime(sim, model, kwargs):
    out = run_one(sim, model, kwargs)
    assert out.error_code == ErrorCode.VALIDATION_ERROR, out.result


def test_unknown_model_and_closed_runtime():
    sim = SimRuntime([DENSE], "cpu", constants=FAST)
    (out,) = sim.run_batch("t/other", [Request("r", "encode", {"items": texts("x")})])
    assert out.error_code == ErrorCode.MODEL_NOT_FOUND
    assert (sim.restarts, sim.poison_isolated, sim.pid) == (0, 0, None)
    sim.close()
    with pytest.raises(RuntimeClosed):
        sim.run_batch(DENSE.id, [Request("r", "encode", {"items": texts("x")})])


# --- time -----------------------------------------------------------------------------------


def test_latency_is_the_scheduler_formula_on_padded_tokens():
    sim = SimRuntime([DENSE], "cpu", constants=(3.0, 40.0, 200.0))
    shape = BatchShape(items=5, longest=30, tokens=70)
    padded = 5 * 30
    expected = 3e-3 + 40e-6 * padded + 200e-9 * padded * 30
    assert sim.latency(DENSE.id, shape) == pytest.approx(expected)
    faster = SimRuntime([DENSE], "cpu", speed=4.0, constants=(3.0, 40.0, 200.0))
    assert faster.latency(DENSE.id, shape) == pytest.approx(expected / 4)


@pytest.mark.parametrize("speed", [1.0, 3.0])
def test_a_batch_sleeps_at_least_its_predicted_latency(speed):
    sim = SimRuntime([DENSE], "cpu", speed=speed, constants=(20.0, 100.0, 1000.0))
    batch = [{"items": texts("a short one", "x" * 100)}, {"items": texts("y" * 60)}]
    estimates = [estimate_request("encode", kwargs, 64) for kwargs in batch]
    shape = BatchShape(items=sum(e[0] for e in estimates), longest=max(e[2] for e in estimates),
                       tokens=sum(e[1] for e in estimates))
    predicted = (0.020 + shape.items * shape.longest * (100e-6 + 1e-6 * shape.longest)) / speed
    assert predicted == pytest.approx(sim.latency(DENSE.id, shape))
    started = time.perf_counter()
    outcomes = sim.run_batch(DENSE.id, [Request(str(i), "encode", kw)
                                        for i, kw in enumerate(batch)])
    elapsed = time.perf_counter() - started
    assert all(o.ok for o in outcomes)
    assert elapsed >= predicted
    assert outcomes[0].result["batch"]["inference_ms"] >= predicted * 1000


def test_only_bad_requests_cost_nothing():
    sim = SimRuntime([DENSE], "cpu", constants=(3_600_000.0, 0.0, 0.0))  # an hour if it slept
    outcomes: list[Outcome] = []
    batch = threading.Thread(target=lambda: outcomes.extend(
        sim.run_batch(DENSE.id, [Request("r", "encode", {"items": []})])), daemon=True)
    batch.start()
    batch.join(timeout=60)
    assert not batch.is_alive(), "a batch of bad requests only slept its latency"
    (out,) = outcomes
    assert out.error_code == ErrorCode.VALIDATION_ERROR


# --- constants ------------------------------------------------------------------------------


def test_explicit_constants_win_then_the_device_profile_then_scaled_cpu():
    model = entry("t/p", "dense", dims=4, profiles={
        "cpu": {"cost_a_ms": 30, "cost_b_us": 300, "cost_c_ns": 6},
        "l4": {"cost_a_ms": 1, "cost_b_us": 2, "cost_c_ns": 3},
    })
    explicit = sim_constants(model, "l4", (7, 8, 9))
    assert (explicit.a_ms, explicit.b_us, explicit.c_ns, explicit.source) == (7, 8, 9, "explicit")
    profile = sim_constants(model, "l4")
    assert (profile.a_ms, profile.b_us, profile.c_ns) == (1, 2, 3)
    assert profile.source == "profile:l4"
    t4 = DEVICE_KINDS["t4"]
    scaled = sim_constants(model, "t4")
    assert scaled.b_us == pytest.approx(300 / t4.speed)
    assert scaled.c_ns == pytest.approx(6 / t4.speed)
    assert scaled.a_ms == pytest.approx(max(30 / t4.speed, t4.min_overhead_ms))
    assert scaled.a_ms >= t4.min_overhead_ms
    cpu = sim_constants(model, "cpu")
    assert (cpu.a_ms, cpu.b_us, cpu.c_ns) == (30, 300, 6)


def test_without_profiles_the_defaults_are_scaled():
    model = entry("t/bare", "dense", dims=4)
    defaults, h100 = BatchProfile(), DEVICE_KINDS["h100"]
    got = sim_constants(model, "H100:0")
    assert got.b_us == pytest.approx(defaults.cost_b_us / h100.speed)
    assert got.a_ms == pytest.approx(max(defaults.cost_a_ms / h100.speed, h100.min_overhead_ms))
    assert sim_constants(model, "cpu").b_us == defaults.cost_b_us


def test_faster_kinds_are_faster():
    speeds = [DEVICE_KINDS[k].speed for k in ("cpu", "t4", "a10", "a100", "h100")]
    assert speeds == sorted(speeds) and speeds[0] == 1.0


def test_unknown_device_names_the_known_ones():
    with pytest.raises(ValueError, match="t4") as info:
        SimRuntime([DENSE], "tpu-v9")
    for kind in DEVICE_KINDS:
        assert kind in str(info.value)
    # A device the catalog has a profile for, or explicit constants, needs no table row.
    mi300 = entry("t/mi", "dense", dims=4, profiles={"mi300": {"cost_b_us": 1}})
    assert SimRuntime([mi300], "mi300").constants("t/mi").b_us == 1
    assert SimRuntime([DENSE], "tpu-v9", constants=(1, 2, 3)).constants(DENSE.id).a_ms == 1


@pytest.mark.parametrize("bad", [(-1, 0, 0), (0, float("nan"), 0), (1, 2)])
def test_bad_constants_or_speed_are_refused(bad):
    with pytest.raises(ValueError):
        SimRuntime([DENSE], "cpu", constants=bad)
    with pytest.raises(ValueError):
        SimRuntime([DENSE], "cpu", speed=0)


# --- settings and imports -------------------------------------------------------------------


def test_settings_take_all_three_costs_or_none():
    assert Settings().runtime == "pytorch" and Settings().sim_constants is None
    settings = Settings(runtime="sim", sim_speed=2, sim_cost_a_ms=1, sim_cost_b_us=2,
                        sim_cost_c_ns=0)
    assert settings.sim_constants == (1, 2, 0)
    with pytest.raises(ValidationError, match="SHOAL_SIM_COST_C_NS"):
        Settings(sim_cost_a_ms=1, sim_cost_b_us=2)
    with pytest.raises(ValidationError):
        Settings(sim_speed=0)
    with pytest.raises(ValidationError):
        Settings(runtime="jax")


def test_the_sim_imports_neither_torch_nor_transformers():
    code = ("import sys, runtimes.doubles.sim; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
