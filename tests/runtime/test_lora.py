"""LoRA adapters per request, against peft's merged model on the same weights.

Three tiny random LoRAs per tiny model (a dense BERT, a Llama, a GPT-2), made with
peft at test time. Each request through a LoRA must give what peft's merged model
gives (`merge_and_unload` on a fresh copy): cosine >= 0.9999 for embeddings, the
same greedy token ids for generation; a batch mixing the base model and every
LoRA must give what each request gives alone; and a LoRA must change the output,
so these tests can fail.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from sentence_transformers import SentenceTransformer
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtimes.base import Outcome, Request
from runtimes.child_side.host import ModelHost
from runtimes.pytorch.adapter import Adapter
from runtimes.pytorch.causal_lm import Row
from runtimes.pytorch.families import ADAPTERS as PYTORCH_ADAPTERS
from tasks.adapters import ADAPTERS
from tasks.catalog import LORA_ADAPTERS, ModelEntry
from tasks.options import GenerateOptions
from tests.tiny_lm import build_tiny_gpt2, build_tiny_llama
from tests.tiny_lora import (
    BERT_TARGETS,
    GPT2_TARGETS,
    LLAMA_TARGETS,
    adapter_file_bytes,
    build_tiny_lora,
    merged_model,
    save_merged,
)
from tests.tiny_models import build_tiny_sentence_transformer

DENSE = "test/tiny-dense"
LLAMA = "test/tiny-llama"
GPT2 = "test/tiny-gpt2"
# A '/' and a '.' in a name: peft's adapter names may hold neither, the catalog's may.
LORAS = ("alpha", "team/beta.v2", "gamma")
TEXTS = ["The cat sits on the mat.", "hello", "a much longer sentence about the rivers of "
         "france and the weather in paris today", "one two three"]
PROMPTS = ["the cat sat on the mat", "hello", "a much longer prompt about the weather in "
           "paris and the rivers of france today", "one two three"]
# Per model: its LoRAs' build arguments (the task types differ on purpose: the runtime
# serves a LoRA whatever task it was saved for).
LORA_BUILDS: dict[str, dict[str, Any]] = {
    DENSE: {"targets": BERT_TARGETS, "task_types": (None, "FEATURE_EXTRACTION", None)},
    LLAMA: {"targets": LLAMA_TARGETS, "task_types": ("CAUSAL_LM", None, "CAUSAL_LM"),
            "model_class": AutoModelForCausalLM},
    GPT2: {"targets": GPT2_TARGETS, "task_types": ("CAUSAL_LM",) * 3,
           "model_class": AutoModelForCausalLM, "fan_in_fan_out": True},
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each model's directory and its LoRAs' directories by name."""
    root = tmp_path_factory.mktemp("lora")
    bases = {
        DENSE: build_tiny_sentence_transformer(root / "dense", pooling="mean", normalize=True),
        LLAMA: build_tiny_llama(root / "llama"),
        GPT2: build_tiny_gpt2(root / "gpt2"),
    }
    out: dict[str, Any] = {}
    for model, base in bases.items():
        build = dict(LORA_BUILDS[model])
        task_types = build.pop("task_types")
        loras = {name: build_tiny_lora(base, root / f"{base.name}-lora{i}", seed=100 + i,
                                       task_type=task_types[i], **build)
                 for i, name in enumerate(LORAS)}
        out[model] = (base, loras)
    return out


def entry(model: str, base: Path, loras: dict[str, Path], dense: bool | None = None
          ) -> ModelEntry:
    dense = model == DENSE if dense is None else dense
    adapter = "dense" if dense else "causal-lm"
    extra = {"dims": 32} if dense else {}
    return ModelEntry.model_validate({
        "id": model, "adapter": adapter, "source": {"path": str(base)},
        "loras": {name: {"path": str(path)} for name, path in loras.items()}, **extra})


@pytest.fixture(scope="module")
def loaded(dirs: dict[str, Any]) -> tuple[ModelHost, dict[str, dict[str, int]]]:
    """A host serving the three models with every LoRA loaded, and what each load said
    its LoRA takes."""
    host = ModelHost()
    sizes: dict[str, dict[str, int]] = {}
    for model, (base, loras) in dirs.items():
        host.load([entry(model, base, loras)])
        adapter = host.adapter(model)
        sizes[model] = {name: adapter.load_lora(name, str(path)) for name, path in loras.items()}
    return host, sizes


@pytest.fixture(scope="module")
def host(loaded) -> ModelHost:
    return loaded[0]


def run(host: ModelHost, model: str, *kwargs_list: dict[str, Any]) -> list[Outcome]:
    op = "encode" if model == DENSE else "generate"
    requests = [Request(str(i), op, {"model": model, **kw}) for i, kw in enumerate(kwargs_list)]
    return host.run_batch(model, requests)


def texts(*values: str) -> list[dict[str, str]]:
    return [{"text": v} for v in values]


def vectors(outcome: Outcome) -> np.ndarray:
    assert outcome.ok, outcome.error_message
    result = outcome.result
    return np.frombuffer(result["embeddings"], "<f4").reshape(result["count"], result["dims"])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def prompt_ids(tokenizer: Any, model: str, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [tokenizer.bos_token_id, *ids] if model == LLAMA else ids


def greedy(model: Any, ids: list[int], max_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                         dtype=torch.long), do_sample=False, max_new_tokens=max_tokens)
    return out[0, len(ids):].tolist()


def test_the_catalog_and_the_runtime_agree_on_which_adapters_take_loras():
    assert LORA_ADAPTERS.issubset(ADAPTERS)
    assert not Adapter.supports_lora
    for name in ADAPTERS:
        if name.endswith("-faulty"):  # test doubles inherit from the real adapters
            continue
        module, _, cls = PYTORCH_ADAPTERS[name].partition(":")
        assert getattr(importlib.import_module(module), cls).supports_lora == \
            (name in LORA_ADAPTERS), name


# --- embeddings --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dense_reference(dirs, tmp_path_factory) -> dict[str | None, np.ndarray]:
    """sentence-transformers' embeddings of TEXTS by the base model (None) and by each
    LoRA merged into a copy of it."""
    base, loras = dirs[DENSE]
    root = tmp_path_factory.mktemp("merged")
    out = {None: SentenceTransformer(str(base), device="cpu").encode(TEXTS)}
    for name, path in loras.items():
        merged = save_merged(base, path, root / path.name)
        out[name] = SentenceTransformer(str(merged), device="cpu").encode(TEXTS)
    return out


def test_each_lora_embeds_as_its_merged_model(host, dense_reference):
    for lora in (None, *LORAS):
        options = {} if lora is None else {"lora": lora}
        (outcome,) = run(host, DENSE, {"items": texts(*TEXTS), "options": options})
        assert cosines(vectors(outcome), dense_reference[lora]).min() >= 0.9999, lora
    # The LoRAs change the vectors, each its own way: comparing with them means something.
    for i, lora in enumerate(LORAS):
        for other in (None, *LORAS[i + 1:]):
            assert cosines(dense_reference[lora], dense_reference[other]).max() < 0.99, \
                (lora, other)


def test_a_mixed_batch_embeds_as_each_request_alone(host, dense_reference):
    # Base and LoRA requests interleaved, of different lengths: the encoder sorts texts
    # by length across requests, so each row must keep its own LoRA through the sort.
    order = [None, "alpha", "team/beta.v2", "gamma", None, "gamma", "alpha", "team/beta.v2"]
    kwargs = [{"items": texts(TEXTS[k % 4], TEXTS[(k + 1) % 4]),
               "options": {} if lora is None else {"lora": lora}}
              for k, lora in enumerate(order)]
    together = run(host, DENSE, *kwargs)
    assert all(o.ok for o in together)
    assert together[0].result["batch"]["requests"] == len(order)  # one batch indeed
    for k, (lora, outcome) in enumerate(zip(order, together, strict=True)):
        (alone,) = run(host, DENSE, kwargs[k])
        np.testing.assert_allclose(vectors(outcome), vectors(alone), rtol=1e-4, atol=1e-5)
        expected = dense_reference[lora][[k % 4, (k + 1) % 4]]
        assert cosines(vectors(outcome), expected).min() >= 0.9999, (k, lora)


# --- generation --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_reference(dirs) -> dict[tuple[str, str | None], Any]:
    """Fresh copies of each language model: the base (None) and each LoRA merged in."""
    out: dict[tuple[str, str | None], Any] = {}
    for model in (LLAMA, GPT2):
        base, loras = dirs[model]
        out[model, None] = AutoModelForCausalLM.from_pretrained(
            str(base), local_files_only=True).eval()
        for name, path in loras.items():
            out[model, name] = merged_model(base, path, AutoModelForCausalLM)
    return out


@pytest.fixture(scope="module")
def tokenizers(dirs) -> dict[str, Any]:
    return {m: AutoTokenizer.from_pretrained(str(dirs[m][0]), local_files_only=True)
            for m in (LLAMA, GPT2)}


@pytest.mark.parametrize("model", [LLAMA, GPT2])
def test_each_lora_generates_the_greedy_tokens_of_its_merged_model(host, lm_reference,
                                                                   tokenizers, model):
    adapter = host.adapter(model)
    tokenizer = tokenizers[model]
    completions: dict[str | None, list[list[int]]] = {}
    for lora in (None, *LORAS):
        rows = [Row(prompt_ids(tokenizer, model, p),
                    GenerateOptions(max_tokens=6 + 3 * k, temperature=0.0, lora=lora))
                for k, p in enumerate(PROMPTS)]
        expected = [greedy(lm_reference[model, lora], r.prompt, r.options.max_tokens)
                    for r in rows]
        assert [g.token_ids for g in adapter.generate(rows)] == expected, lora
        completions[lora] = expected
    for i, lora in enumerate(LORAS):
        for other in (None, *LORAS[i + 1:]):
            assert completions[lora] != completions[other], (lora, other)


@pytest.mark.parametrize("model", [LLAMA, GPT2])
def test_a_mixed_batch_generates_as_each_row_alone(host, lm_reference, tokenizers, model):
    adapter = host.adapter(model)
    tokenizer = tokenizers[model]
    order = [None, "alpha", "team/beta.v2", "gamma", "gamma", None, "team/beta.v2", "alpha"]
    # Different lengths: rows leave the batch at different steps, and the LoRA of each
    # slot must follow its row.
    rows = [Row(prompt_ids(tokenizer, model, PROMPTS[k % 4]),
                GenerateOptions(max_tokens=3 + 2 * k, temperature=0.0, lora=lora))
            for k, lora in enumerate(order)]
    together = [g.token_ids for g in adapter.generate(rows)]
    alone = [adapter.generate([r])[0].token_ids for r in rows]
    expected = [greedy(lm_reference[model, r.options.lora], r.prompt, r.options.max_tokens)
                for r in rows]
    assert together == alone == expected


def test_lora_requests_through_the_host(host, lm_reference, tokenizers):
    options = {"temperature": 0, "max_tokens": 5}
    outcomes = run(host, LLAMA,
                   {"items": texts(PROMPTS[0], PROMPTS[1]), "options": {**options,
                                                                        "lora": "gamma"}},
                   {"items": texts(PROMPTS[2]), "options": options},
                   {"items": texts(PROMPTS[3]), "options": {**options, "lora": "alpha"}})
    tokenizer = tokenizers[LLAMA]
    for outcome, prompts, lora in zip(outcomes, (PROMPTS[:2], PROMPTS[2:3], PROMPTS[3:]),
                                      ("gamma", None, "alpha"), strict=True):
        assert outcome.ok, outcome.error_message
        for choice, prompt in zip(outcome.result["choices"], prompts, strict=True):
            ids = greedy(lm_reference[LLAMA, lora], prompt_ids(tokenizer, LLAMA, prompt), 5)
            assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)


# --- loading, sizes, errors --------------------------------------------------------------


def test_load_lora_says_what_the_adapter_tensors_take(dirs, loaded):
    _, sizes = loaded
    for model, (_, loras) in dirs.items():
        for name, path in loras.items():
            on_disk = adapter_file_bytes(path)
            assert on_disk > 0 and abs(sizes[model][name] - on_disk) <= 0.1 * on_disk, \
                (model, name, sizes[model][name], on_disk)


def test_a_lora_the_catalog_does_not_list_is_not_found(host, dirs):
    (outcome,) = run(host, DENSE, {"items": texts("x"), "options": {"lora": "delta"}})
    assert outcome.error_code == "LORA_NOT_FOUND"
    assert all(name in outcome.error_message for name in LORAS)
    plain = ModelHost()
    base, _ = dirs[DENSE]
    plain.load([entry("test/no-loras", base, {}, dense=True)])
    (outcome,) = plain.run_batch("test/no-loras", [Request("1", "encode", {
        "items": texts("x"), "options": {"lora": "alpha"}})])
    assert outcome.error_code == "LORA_NOT_FOUND" and "no LoRA adapters" in outcome.error_message


def request(model: str, lora: str | None = None) -> dict[str, Any]:
    """A small request to `model` (through `lora`, if given)."""
    options: dict[str, Any] = {} if model == DENSE else {"max_tokens": 4, "temperature": 0}
    if lora is not None:
        options["lora"] = lora
    return {"items": texts(*(TEXTS if model == DENSE else PROMPTS[:1])), "options": options}


def answer(outcome: Outcome) -> Any:
    """What a request answered, less the batch stamps (timings)."""
    assert outcome.ok, outcome.error_message
    return outcome.result.get("embeddings", outcome.result.get("choices"))


def module_types(adapter: Adapter) -> dict[str, type]:
    return {name: type(m) for name, m in adapter.loras.model.named_modules()}


@pytest.mark.parametrize("model", [DENSE, LLAMA])
def test_unloading_leaves_the_plain_model(dirs, model):
    """Loads and unloads on a host of its own: an unloaded LoRA is MODEL_UNAVAILABLE, and
    once the last is gone the model is unwrapped and answers exactly as before."""
    base, loras = dirs[model]
    host = ModelHost()
    host.load([entry(model, base, loras)])
    adapter = host.adapter(model)
    before, modules = answer(run(host, model, request(model))[0]), module_types(adapter)

    (outcome,) = run(host, model, request(model, "alpha"))
    assert outcome.error_code == "MODEL_UNAVAILABLE"
    assert outcome.error_message == f"LoRA alpha of model {model} is not loaded"

    for name in ("alpha", "gamma"):
        adapter.load_lora(name, str(loras[name]))
    assert adapter.loaded_loras == {"alpha", "gamma"} and adapter.loras.peft is not None
    with pytest.raises(ValueError, match="loaded already"):
        adapter.load_lora("alpha", str(loras["alpha"]))
    assert answer(run(host, model, request(model, "alpha"))[0]) != before
    adapter.unload_lora("alpha")
    assert adapter.loaded_loras == {"gamma"}
    outcomes = run(host, model, request(model, "alpha"), request(model, "gamma"),
                   request(model))
    assert [o.error_code for o in outcomes] == ["MODEL_UNAVAILABLE", None, None]
    assert answer(outcomes[2]) == before

    adapter.unload_lora("gamma")
    assert adapter.loaded_loras == set() and adapter.loras.peft is None
    assert module_types(adapter) == modules
    assert not any(isinstance(m, BaseTunerLayer) for m in adapter.loras.model.modules())
    assert not hasattr(adapter.loras.model, "peft_config")
    assert answer(run(host, model, request(model))[0]) == before
    with pytest.raises(KeyError):
        adapter.unload_lora("gamma")
    # And it loads again.
    adapter.load_lora("gamma", str(loras["gamma"]))
    assert run(host, model, request(model, "gamma"))[0].ok


def test_a_lora_that_cannot_load_leaves_the_model_as_it_was(dirs, tmp_path):
    base, loras = dirs[DENSE]
    dora = build_tiny_lora(base, tmp_path / "dora", targets=BERT_TARGETS)
    config = dora / "adapter_config.json"
    config.write_text(config.read_text().replace('"use_dora": false', '"use_dora": true'))
    bad = {
        dirs[LLAMA][1]["alpha"]: "not found in the base model",  # a Llama's target modules
        dora: "DoRA",  # peft cannot mix DoRA in a batch
        tmp_path / "missing": "adapter_config.json",
    }
    host = ModelHost()
    host.load([entry(DENSE, base, loras)])
    adapter = host.adapter(DENSE)
    before, modules = answer(run(host, DENSE, request(DENSE))[0]), module_types(adapter)
    for path, message in bad.items():  # failing to wrap the model
        with pytest.raises(ValueError, match=message):
            adapter.load_lora("bad", str(path))
        assert adapter.loaded_loras == set() and adapter.loras.peft is None
        assert module_types(adapter) == modules
    assert answer(run(host, DENSE, request(DENSE))[0]) == before

    adapter.load_lora("alpha", str(loras["alpha"]))
    alpha = answer(run(host, DENSE, request(DENSE, "alpha"))[0])
    for path, message in bad.items():  # failing to add one to the wrapped model
        with pytest.raises(ValueError, match=message):
            adapter.load_lora("bad", str(path))
        assert adapter.loaded_loras == {"alpha"} and set(adapter.loras.peft.peft_config) == \
            {adapter.loras._peft_names["alpha"]}
    base_now, alpha_now = run(host, DENSE, request(DENSE), request(DENSE, "alpha"))
    assert (answer(base_now), answer(alpha_now)) == (before, alpha)
    adapter.unload_lora("alpha")
    assert module_types(adapter) == modules
    assert answer(run(host, DENSE, request(DENSE))[0]) == before


def test_an_adapter_without_lora_support_refuses_to_load_one(dirs):
    class Plain(Adapter):
        def run(self, prepared):
            return []

    base, _ = dirs[DENSE]
    adapter = Plain(entry(DENSE, base, {}), str(base))
    assert adapter.loaded_loras == set()
    with pytest.raises(NotImplementedError):
        adapter.load_lora("alpha", str(base))
