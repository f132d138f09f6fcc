"""The causal-lm adapter against `model.generate` on the same tiny weights.

Greedy decoding must give the very token ids of `generate(do_sample=False)`,
whether a prompt runs alone or left-padded in a batch with others; the rest
checks sampling seeds, stop conditions, chat prompts and per-request errors
through the model host, as the worker calls it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtimes.base import Outcome, Request
from runtimes.child_side.host import ModelHost
from runtimes.pytorch.causal_lm import CausalLMAdapter, Row
from tasks.catalog import ModelEntry
from tasks.options import GenerateOptions
from tests.tiny_lm import CONTEXT, build_tiny_gpt2, build_tiny_llama

LLAMA = "test/tiny-llama"
GPT2 = "test/tiny-gpt2"
PROMPTS = [
    "the cat sat on the mat",
    "hello",
    "a much longer prompt about the weather in paris and the rivers of france today",
    "one two three",
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-lm")
    return {LLAMA: build_tiny_llama(root / "llama"), GPT2: build_tiny_gpt2(root / "gpt2")}


def _entry(model_id: str, path: Path) -> ModelEntry:
    return ModelEntry.model_validate({"id": model_id, "adapter": "causal-lm",
                                      "source": {"path": str(path)}})


@pytest.fixture(scope="module")
def host(dirs: dict[str, Path]) -> ModelHost:
    host = ModelHost()
    host.load([_entry(model_id, path) for model_id, path in dirs.items()])
    return host


@pytest.fixture(scope="module")
def reference(dirs: dict[str, Path]) -> dict[str, Any]:
    """Independently loaded copies of the weights, for `generate`."""
    return {m: AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True).eval()
            for m, p in dirs.items()}


@pytest.fixture(scope="module")
def tokenizers(dirs: dict[str, Path]) -> dict[str, Any]:
    return {m: AutoTokenizer.from_pretrained(str(p), local_files_only=True)
            for m, p in dirs.items()}


def prompt_ids(tokenizer: Any, model_id: str, text: str) -> list[int]:
    """What the adapter should feed: the Llama-style tokenizer adds BOS by itself, so the
    prompt gets it; GPT-2's does not; neither gets the [SEP] a BERT tokenizer appends."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [tokenizer.bos_token_id, *ids] if model_id == LLAMA else ids


def greedy(model: Any, ids: list[int], max_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                         dtype=torch.long), do_sample=False, max_new_tokens=max_tokens)
    return out[0, len(ids):].tolist()


def run(host: ModelHost, model_id: str, *kwargs_list: dict[str, Any]) -> list[Outcome]:
    requests = [Request(str(i), "generate", {"model": model_id, **kw})
                for i, kw in enumerate(kwargs_list)]
    return host.run_batch(model_id, requests)


def texts(*prompts: str) -> list[dict[str, str]]:
    return [{"text": p} for p in prompts]


@pytest.mark.parametrize("model_id", [LLAMA, GPT2])
def test_greedy_token_ids_match_generate_alone_and_batched(host, reference, tokenizers,
                                                           model_id):
    adapter = host.adapter(model_id)
    tokenizer = tokenizers[model_id]
    rows = [Row(prompt_ids(tokenizer, model_id, p), GenerateOptions(max_tokens=6 + 5 * k,
                                                                    temperature=0.0))
            for k, p in enumerate(PROMPTS)]
    expected = [greedy(reference[model_id], r.prompt, r.options.max_tokens) for r in rows]
    assert len({len(r.prompt) for r in rows}) == len(rows)  # left padding differs per row
    batched = adapter.generate(rows)
    assert [g.token_ids for g in batched] == expected
    assert [adapter.generate([r])[0].token_ids for r in rows] == expected
    # Rows that leave the batch early (short max_tokens) must not disturb the others.
    assert [g.finish_reason for g in batched] == ["length"] * len(rows)


@pytest.mark.parametrize("model_id", [LLAMA, GPT2])
def test_greedy_requests_through_the_host(host, reference, tokenizers, model_id):
    tokenizer = tokenizers[model_id]
    first, second, third = run(
        host, model_id,
        {"items": texts(PROMPTS[0], PROMPTS[1]), "options": {"temperature": 0, "max_tokens": 7}},
        {"items": texts(PROMPTS[2]), "options": {"temperature": 0, "max_tokens": 12}},
        {"items": texts(PROMPTS[3]), "options": {"temperature": 0.9, "seed": 3}},
    )
    assert first.ok and second.ok and third.ok
    for outcome, prompts, max_tokens in ((first, PROMPTS[:2], 7), (second, PROMPTS[2:3], 12)):
        result = outcome.result
        for i, (choice, prompt) in enumerate(zip(result["choices"], prompts, strict=True)):
            ids = prompt_ids(tokenizer, model_id, prompt)
            completion = greedy(reference[model_id], ids, max_tokens)
            assert choice == {
                "index": i,
                "text": tokenizer.decode(completion, skip_special_tokens=True),
                "finish_reason": "length",
                "prompt_tokens": len(ids),
                "completion_tokens": max_tokens,
            }
        usage = result["usage"]
        assert usage["prompt_tokens"] == sum(c["prompt_tokens"] for c in result["choices"])
        assert usage["completion_tokens"] == max_tokens * len(prompts)
        assert usage["tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert msgpack.unpackb(msgpack.packb(result)) == result
    assert first.result["batch"]["requests"] == 3


def _sampled(outcome: Outcome) -> list[str]:
    assert outcome.ok, outcome.error_message
    return [c["text"] for c in outcome.result["choices"]]


def test_seed_gives_the_same_text_alone_and_in_any_batch(host):
    seeded = {"items": texts("hello", "hello"),
              "options": {"seed": 42, "temperature": 1.0, "top_p": 0.9, "max_tokens": 8}}
    (alone,) = run(host, LLAMA, seeded)
    (again,) = run(host, LLAMA, seeded)
    _, batched, _ = run(
        host, LLAMA,
        {"items": texts(PROMPTS[2]), "options": {"seed": 1, "max_tokens": 12}},
        seeded,
        {"items": texts(PROMPTS[0], "x"), "options": {"temperature": 0, "max_tokens": 3}},
    )
    first, second = _sampled(alone)
    assert _sampled(again) == _sampled(batched) == [first, second]
    assert first != second  # each item of a request draws its own stream
    other_seed = {**seeded, "options": {**seeded["options"], "seed": 43}}
    assert _sampled(run(host, LLAMA, other_seed)[0]) != [first, second]
    unseeded = {**seeded, "options": {"temperature": 1.0, "max_tokens": 8}}
    assert _sampled(run(host, LLAMA, unseeded)[0]) != _sampled(run(host, LLAMA, unseeded)[0])


def test_max_tokens_ends_with_length(host):
    (outcome,) = run(host, GPT2, {"items": texts("hello", PROMPTS[2]),
                                  "options": {"max_tokens": 1, "seed": 0}})
    for choice in outcome.result["choices"]:
        assert (choice["completion_tokens"], choice["finish_reason"]) == (1, "length")
    assert outcome.result["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("model_id", [LLAMA, GPT2])
def test_stop_string_cuts_the_text_before_it(host, model_id):
    greedy_options = {"temperature": 0, "max_tokens": 20}
    (full,) = run(host, model_id, {"items": texts(PROMPTS[0]), "options": greedy_options})
    text = full.result["choices"][0]["text"]
    words = text.split()
    stop = next(w for w in words[2:] if text.find(w) > 0)
    options = {**greedy_options, "stop": ["no such text anywhere", stop]}
    (cut,) = run(host, model_id, {"items": texts(PROMPTS[0]), "options": options})
    choice = cut.result["choices"][0]
    assert choice["text"] == text[: text.find(stop)]
    assert choice["finish_reason"] == "stop"
    assert choice["completion_tokens"] < 20


def test_eos_ends_with_stop_and_is_not_in_the_text(dirs, tokenizers):
    adapter = CausalLMAdapter(_entry(LLAMA, dirs[LLAMA]), str(dirs[LLAMA]))
    row = Row(prompt_ids(tokenizers[LLAMA], LLAMA, PROMPTS[0]),
              GenerateOptions(max_tokens=10, temperature=0.0))
    (full,) = adapter.generate([row])
    # Random weights never pick [SEP]: make the fourth greedy token the end of text.
    eos = full.token_ids[3]
    first = full.token_ids.index(eos)
    adapter.eos_ids = frozenset({eos})
    (ended,) = adapter.generate([row])
    assert ended.token_ids == full.token_ids[: first + 1]
    assert ended.finish_reason == "stop"
    assert ended.text == tokenizers[LLAMA].decode(full.token_ids[:first],
                                                  skip_special_tokens=True)


def test_chat_messages_use_the_chat_template(host, reference, tokenizers):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    (outcome,) = run(host, LLAMA, {"items": [{"messages": messages}],
                                   "options": {"temperature": 0, "max_tokens": 9}})
    tokenizer = tokenizers[LLAMA]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    assert rendered.endswith("<assistant> ")
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    choice = outcome.result["choices"][0]
    assert choice["prompt_tokens"] == len(ids)
    assert choice["text"] == tokenizer.decode(greedy(reference[LLAMA], ids, 9),
                                              skip_special_tokens=True)


def test_chat_without_a_template_fails_alone(host):
    chat, plain = run(
        host, GPT2,
        {"items": [{"messages": [{"role": "user", "content": "hi"}]}]},
        {"items": texts("hi"), "options": {"max_tokens": 2}},
    )
    assert chat.error_code == "VALIDATION_ERROR"
    assert "no chat template" in chat.error_message and "/v1/completions" in chat.error_message
    assert plain.ok and plain.result["choices"][0]["completion_tokens"] == 2
    assert plain.result["batch"]["requests"] == 1


def test_prompt_plus_max_tokens_over_the_context_fails_alone(host, tokenizers):
    tokenizer = tokenizers[LLAMA]
    prompt = "word " * (CONTEXT - 16 - 1)  # with BOS: exactly CONTEXT - 16 tokens
    assert len(prompt_ids(tokenizer, LLAMA, prompt)) == CONTEXT - 16
    fits, over, empty_ok = run(
        host, LLAMA,
        {"items": texts(prompt), "options": {"max_tokens": 16, "temperature": 0}},
        {"items": texts("hi", prompt), "options": {"max_tokens": 17}},
        {"items": texts(""), "options": {"max_tokens": 2}},
    )
    assert fits.ok and fits.result["choices"][0]["prompt_tokens"] == CONTEXT - 16
    assert over.error_code == "INPUT_TOO_LONG"
    assert "items[1]" in over.error_message and "max_tokens" in over.error_message
    assert f"{CONTEXT}" in over.error_message
    # An empty prompt still has the BOS token to start from.
    assert empty_ok.ok and empty_ok.result["choices"][0]["prompt_tokens"] == 1


def test_empty_prompt_without_bos_is_invalid(host):
    (outcome,) = run(host, GPT2, {"items": texts("")})
    assert outcome.error_code == "VALIDATION_ERROR" and "items[0]" in outcome.error_message


def test_chunks_by_padded_tokens_keep_results(host, dirs, tokenizers):
    rows = [Row(prompt_ids(tokenizers[GPT2], GPT2, p), GenerateOptions(max_tokens=5,
                                                                       temperature=0.0))
            for p in PROMPTS]
    whole = host.adapter(GPT2).generate(rows)
    small = CausalLMAdapter(_entry(GPT2, dirs[GPT2]), str(dirs[GPT2]), chunk_tokens=30)
    assert [g.token_ids for g in small.generate(rows)] == [g.token_ids for g in whole]


@pytest.mark.parametrize("model_id", [LLAMA, GPT2])
def test_token_id_prompts_run_as_given_beside_texts(host, tokenizers, model_id):
    """A tokens item is the prompt as sent, nothing added or dropped: the ids a text prompt
    becomes (BOS where the tokenizer puts one first, no end token) complete as the text
    does; an id the tokenizer does not have fails its own request."""
    tokenizer = tokenizers[model_id]
    options = {"temperature": 0, "max_tokens": 6}
    ids = prompt_ids(tokenizer, model_id, PROMPTS[0])
    text, tokens, bad = run(
        host, model_id,
        {"items": texts(PROMPTS[0]), "options": options},
        {"items": [{"tokens": ids}, {"text": PROMPTS[1]}], "options": options},
        {"items": [{"tokens": [1, len(tokenizer)]}], "options": options})
    assert text.ok and tokens.ok, [text.error_message, tokens.error_message]
    assert tokens.result["choices"][0] == text.result["choices"][0]
    assert bad.error_code == "VALIDATION_ERROR"
    assert f"items[0] has token id {len(tokenizer)}, but {model_id}'s vocabulary has " \
        f"{len(tokenizer)} ids" in bad.error_message
