"""Every adapter family through the whole stack: HTTP -> RabbitMQ -> worker -> runtime.

Each family is a tiny random model of a real architecture, saved with
save_pretrained and served like a user's model; results are compared with a
direct transformers computation on the same weights (tests/runtime/ checks
each adapter in depth; here the point is that the stack carries it intact).
"""

from __future__ import annotations

import io

import httpx
import msgpack
import numpy as np
import pytest
import torch
from openai import OpenAI
from PIL import Image

from tests.conftest import (
    CLIP,
    COLBERT,
    FAMILIES_WORKER,
    LLAMA,
    MINILM,
    NER,
    NLI,
    RERANKER,
    SENTIMENT,
    SPLADE,
    family_dir,
)

pytestmark = pytest.mark.e2e
TEXTS = ["The cat sits on the mat.", "Angela Merkel visited Paris in May.", "Grüße aus Köln"]


def post(live, path: str, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=60, **kwargs)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def png(colour: tuple[int, int, int], size: int = 40) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(out, format="PNG")
    return out.getvalue()


def test_models_lists_every_family(families):
    data = {m["id"]: m for m in httpx.get(f"{families.url}/v1/models",
                                          params={"all": "true"}).json()["data"]}
    assert data[RERANKER]["tasks"] == ["score"] and data[CLIP]["inputs"] == ["image", "text"]
    assert data[COLBERT]["outputs"] == ["multivector"] and data[COLBERT]["dims"] == 16
    assert data[LLAMA]["tasks"] == ["generate"]


@torch.inference_mode()
def test_sparse_matches_splade_on_the_same_weights(families):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    body = ok(post(families, f"/v1/encode/{SPLADE}", {"items": [{"text": t} for t in TEXTS]}))
    assert body["output"] == "sparse" and len(body["embeddings"]) == len(TEXTS)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(SPLADE))
    model = AutoModelForMaskedLM.from_pretrained(family_dir(SPLADE)).eval()
    for text, got in zip(TEXTS, body["embeddings"], strict=True):
        logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
        expected = torch.log1p(torch.relu(logits)).max(dim=0).values.numpy()
        assert got["indices"] == sorted(got["indices"]) and min(got["values"]) > 0
        dense = np.zeros_like(expected)
        dense[got["indices"]] = got["values"]
        # Compared densely: a weight within rounding of zero may be kept or dropped.
        np.testing.assert_allclose(dense, expected, atol=1e-5)
    again = ok(post(families, f"/v1/encode/{SPLADE}", {"items": [{"text": t} for t in TEXTS]}))
    assert again["embeddings"] == body["embeddings"]


def test_multivector_gives_unit_vectors_per_token(families):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(family_dir(COLBERT))
    docs = ok(post(families, f"/v1/encode/{COLBERT}", {"items": [{"text": t} for t in TEXTS]}))
    assert docs["output"] == "multivector" and docs["dims"] == 16
    for text, vectors in zip(TEXTS, docs["embeddings"], strict=True):
        assert len(vectors) == len(tokenizer(text)["input_ids"])
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    query = ok(post(families, f"/v1/encode/{COLBERT}",
                    {"items": [{"text": "cats?"}], "options": {"is_query": True}}))
    assert len(query["embeddings"][0]) == 32  # ColBERT pads queries with [MASK] to 32


@torch.inference_mode()
def test_clip_embeds_images_and_texts_in_one_request(families):
    from transformers import AutoImageProcessor, AutoModel

    red, blue = png((220, 20, 20)), png((20, 20, 220), size=64)
    body = msgpack.packb({"items": [{"image": red}, {"text": "a red square"}, {"image": blue}]})
    r = httpx.post(f"{families.url}/v1/encode/{CLIP}", content=body, timeout=60,
                   headers={"content-type": "application/msgpack"})
    assert r.status_code == 200, r.text
    got = np.array(msgpack.unpackb(r.content)["embeddings"], dtype=np.float32)
    assert got.shape == (3, 16)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    model = AutoModel.from_pretrained(family_dir(CLIP)).eval()
    processor = AutoImageProcessor.from_pretrained(family_dir(CLIP))
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in (red, blue)]
    features = model.get_image_features(**processor(images=images, return_tensors="pt"))
    features = getattr(features, "pooler_output", features)
    expected = torch.nn.functional.normalize(features, dim=-1).numpy()
    assert (got[[0, 2]] * expected).sum(axis=1).min() >= 0.9999
    # JSON carries the same bytes as base64; dtype and dimensions apply to images too.
    import base64

    small = ok(post(families, f"/v1/encode/{CLIP}", {
        "items": [{"image": base64.b64encode(red).decode()}],
        "options": {"dimensions": 8, "dtype": "int8"}}))
    assert small["dtype"] == "int8" and len(small["embeddings"][0]) == 8
    assert max(abs(v) for v in small["embeddings"][0]) == 127


@torch.inference_mode()
def test_score_ranks_items_like_the_cross_encoder(families):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    query = "where is the cat?"
    body = ok(post(families, f"/v1/score/{RERANKER}",
                   {"query": query, "items": [{"text": t} for t in TEXTS]}))
    tokenizer = AutoTokenizer.from_pretrained(family_dir(RERANKER))
    model = AutoModelForSequenceClassification.from_pretrained(family_dir(RERANKER)).eval()
    inputs = tokenizer([query] * len(TEXTS), TEXTS, padding=True, return_tensors="pt")
    expected = torch.sigmoid(model(**inputs).logits[:, 0]).tolist()
    results = body["results"]
    assert [r["rank"] for r in results] == [1, 2, 3]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -expected[i])
    for r in results:
        assert r["score"] == pytest.approx(expected[r["index"]], abs=1e-5)
    top = ok(post(families, f"/v1/score/{RERANKER}", {
        "query": query, "items": [{"text": t} for t in TEXTS], "options": {"top_n": 1}}))
    assert top["results"] == results[:1]


def test_extract_matches_the_transformers_pipeline(families):
    from transformers import pipeline

    body = ok(post(families, f"/v1/extract/{NER}", {"items": [{"text": t} for t in TEXTS]}))
    reference = pipeline("token-classification", model=str(family_dir(NER)),
                         aggregation_strategy="simple", device="cpu")
    for text, got, expected in zip(TEXTS, body["entities"], reference(TEXTS), strict=True):
        assert [(e["label"], e["start"], e["end"]) for e in got] == \
            [(e["entity_group"], e["start"], e["end"]) for e in expected]
        for entity, ref in zip(got, expected, strict=True):
            assert entity["text"] == text[entity["start"]:entity["end"]]
            assert entity["score"] == pytest.approx(float(ref["score"]), abs=1e-4)
    assert any(body["entities"]), "the tiny NER model should tag something"


def test_classify_with_the_models_labels(families):
    from transformers import pipeline

    body = ok(post(families, f"/v1/classify/{SENTIMENT}",
                   {"items": [{"text": t} for t in TEXTS]}))
    reference = pipeline("text-classification", model=str(family_dir(SENTIMENT)), top_k=None,
                         device="cpu")(TEXTS)
    for got, expected in zip(body["labels"], reference, strict=True):
        assert [g["label"] for g in got] == [e["label"] for e in expected]
        assert [g["score"] for g in got] == pytest.approx([e["score"] for e in expected],
                                                          abs=1e-5)


def test_zero_shot_with_caller_labels(families):
    from transformers import pipeline

    labels = ["weather", "politics", "animals"]
    body = ok(post(families, f"/v1/classify/{NLI}", {
        "items": [{"text": t} for t in TEXTS], "options": {"labels": labels, "top_k": 2}}))
    reference = pipeline("zero-shot-classification", model=str(family_dir(NLI)), device="cpu")
    for text, got in zip(TEXTS, body["labels"], strict=True):
        expected = reference(text, candidate_labels=labels)
        assert [g["label"] for g in got] == expected["labels"][:2]
        assert [g["score"] for g in got] == pytest.approx(expected["scores"][:2], abs=1e-5)


@torch.inference_mode()
def test_openai_completions_and_chat_are_greedy_at_temperature_zero(families):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(family_dir(LLAMA))
    model = AutoModelForCausalLM.from_pretrained(family_dir(LLAMA)).eval()

    def greedy(prompt_ids: list[int], n: int) -> str:
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=n,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
        return tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)

    client = OpenAI(base_url=f"{families.url}/v1", api_key="unused")
    completion = client.completions.create(model=LLAMA, prompt="The cat sits", max_tokens=6,
                                           temperature=0)
    choice = completion.choices[0]
    # A text prompt starts with BOS and gets no end token (see runtimes.pytorch.causal_lm).
    prompt_ids = [tokenizer.bos_token_id, *tokenizer("The cat sits",
                                                     add_special_tokens=False)["input_ids"]]
    assert choice.text == greedy(prompt_ids, 6)
    assert completion.usage.completion_tokens <= 6 and completion.usage.prompt_tokens > 0
    assert choice.finish_reason in ("stop", "length")

    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model=LLAMA, messages=messages, max_tokens=5,
                                          temperature=0)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert chat.choices[0].message.content == greedy(prompt_ids, 5)
    assert chat.choices[0].message.role == "assistant"


def test_sampling_with_a_seed_repeats(families):
    body = {"model": LLAMA, "prompt": ["Once upon a time", "Hi"], "max_tokens": 8,
            "temperature": 1.0, "top_p": 0.9, "seed": 1234}
    first = ok(post(families, "/v1/completions", body))
    second = ok(post(families, "/v1/completions", body))
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in second["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1]
    default = ok(post(families, "/v1/completions", {"model": LLAMA, "prompt": "x"}))
    assert default["usage"]["completion_tokens"] <= 8  # the entry's default max_tokens


def test_celery_clients_call_every_operation(families):
    from tasks.client import classify, encode, ranked, score

    scored = score.delay(model=RERANKER, query="cat", items=[{"text": t} for t in TEXTS])
    result = scored.get(timeout=60)
    assert len(result["scores"]) == 3 and ranked(result)[0]["rank"] == 1
    labels = classify.delay(model=NLI, items=[{"text": "rain"}],
                            options={"labels": ["weather", "sport"]}).get(timeout=60)
    assert {entry["label"] for entry in labels["labels"][0]} == {"weather", "sport"}
    vectors = encode.delay(model=CLIP, items=[{"image": png((0, 200, 0))}]).get(timeout=60)
    assert vectors["dims"] == 16 and vectors["count"] == 1


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    return r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,status,code,fragment", [
    (f"/v1/encode/{MINILM}", {"items": [{"image": "iVBORw0KGgo="}]}, 422, "VALIDATION_ERROR",
     "takes text only"),
    (f"/v1/score/{RERANKER}", {"items": [{"text": "doc"}]}, 422, "VALIDATION_ERROR",
     "'query' is missing"),
    (f"/v1/classify/{NLI}", {"items": [{"text": "doc"}]}, 422, "VALIDATION_ERROR",
     "options.labels is missing"),
    (f"/v1/classify/{SENTIMENT}", {"items": [{"text": "doc"}], "options": {"labels": ["a"]}},
     422, "VALIDATION_ERROR", "options.labels"),
    (f"/v1/encode/{CLIP}", {"items": [{"image": "bm90IGFuIGltYWdl"}]}, 422, "VALIDATION_ERROR",
     "could not be decoded"),
    (f"/v1/encode/{CLIP}", {"items": [{"image": "%%%"}]}, 422, "VALIDATION_ERROR", "base64"),
    (f"/v1/extract/{NER}", {"items": [{"text": "word " * 300}], "options": {"truncate": False}},
     413, "INPUT_TOO_LONG", "items[0]"),
    (f"/v1/score/{RERANKER}", {"query": "q", "items": [{"text": "w " * 300}],
                               "options": {"truncate": False}}, 413, "INPUT_TOO_LONG", "items"),
    (f"/v1/score/{MINILM}", {"query": "q", "items": [{"text": "d"}]}, 422,
     "UNSUPPORTED_OPERATION", "/v1/encode"),
    # The OpenAI routes answer 400 where the native ones answer 422 or 413, as OpenAI does.
    ("/v1/embeddings", {"model": SPLADE, "input": "x"}, 400, "VALIDATION_ERROR", "sparse"),
    ("/v1/embeddings", {"model": RERANKER, "input": "x"}, 400, "UNSUPPORTED_OPERATION",
     "/v1/score"),
    ("/v1/completions", {"model": LLAMA, "prompt": "x", "stream": "yes"}, 400,
     "VALIDATION_ERROR", "'stream' must be true or false"),
    ("/v1/completions", {"model": LLAMA, "prompt": "x", "n": 2}, 400, "VALIDATION_ERROR", "'n'"),
    ("/v1/completions", {"model": LLAMA, "prompt": "x", "max_tokens": 10_000}, 400,
     "VALIDATION_ERROR", "max_tokens"),
    ("/v1/completions", {"model": LLAMA, "prompt": "word " * 250, "max_tokens": 64}, 400,
     "INPUT_TOO_LONG", "max_tokens"),
    ("/v1/chat/completions", {"model": LLAMA, "messages": [{"role": "user", "content": 5}]},
     400, "VALIDATION_ERROR", "content"),
    (f"/v1/encode/{COLBERT}", {"items": [{"text": "x"}], "options": {"dtype": "int8"}}, 422,
     "VALIDATION_ERROR", "dtype"),
])
def test_bad_input_gets_a_clear_4xx(families, path, body, status, code, fragment):
    assert fragment in _error(post(families, path, body), status, code)


def test_a_bad_image_fails_alone_and_the_worker_carries_on(families):
    import asyncio

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=families.url, timeout=60) as client:
            # Sent together, so the worker likely batches them; either way one fails alone.
            path = f"/v1/encode/{CLIP}"
            bad = client.post(path, json={"items": [{"image": "bm90IGFuIGltYWdl"}]})
            good = client.post(path, headers={"content-type": "application/msgpack"},
                               content=msgpack.packb({"items": [{"image": png((9, 9, 9))}]}))
            return await asyncio.gather(bad, good)

    bad, good = asyncio.run(both())
    assert bad.status_code == 422 and good.status_code == 200
    # Truncation on (the default) serves what failed above with truncate false.
    long_text = {"items": [{"text": "word " * 300}]}
    assert ok(post(families, f"/v1/extract/{NER}", long_text))["usage"]["tokens"] > 0
    assert FAMILIES_WORKER in [p.name for p in families.stack.processes if p.alive()]
