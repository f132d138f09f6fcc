"""docs/clients.md's snippets, run as written against the session stack with the client SDKs
and frameworks users have (their own venv, .venv-clients: `make clients`).

Each snippet runs in a subprocess of that venv's python (tests/clients/run_snippets.py) with
only the base URL and the model names swapped for the test stack's; a probe, an expression
over the snippet's variables, hands back what the test checks against references computed
here: vectors against sentence-transformers on the packaged MiniLM (cosine >= 0.99999),
rerank scores against /v1/score, chat answers against /v1/chat/completions. The snippets
start together (their imports take seconds each) and each test waits for its own.
"""

from __future__ import annotations

import base64
import contextlib
import io
import itertools
import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest

from tests.conftest import CLIP, LLAMA, MINILM, RERANKER, SENTIMENT
from tests.stack import REPO, free_port, wait_for
from tests.tiny_models import MINILM_DIR

pytestmark = pytest.mark.e2e

DOC = REPO / "docs" / "clients.md"
CLIENTS_PYTHON = REPO / ".venv-clients" / "bin" / "python"
RUNNER = REPO / "tests" / "clients" / "run_snippets.py"
DOC_URL = 'SHOAL_URL = "http://localhost:8080"'
# The docs' models, and what the test stack serves in their place (tests/conftest.py).
DOC_MODELS = {"cross-encoder/ms-marco-MiniLM-L6-v2": RERANKER,
              "HuggingFaceTB/SmolLM2-135M-Instruct": LLAMA,
              "distilbert/distilbert-base-uncased-finetuned-sst-2-english": SENTIMENT,
              "openai/clip-vit-base-patch32": CLIP}
SNIPPET = re.compile(r"<!-- test: ([\w-]+) -->\n```python\n(.*?)```", re.S)
# What the clients would otherwise send off this machine (telemetry, litellm's price list)
# is switched off; anything left goes to a closed local port instead of the network.
QUIET = {"HAYSTACK_TELEMETRY_ENABLED": "False", "ANONYMIZED_TELEMETRY": "False",
         "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LANGCHAIN_TRACING_V2": "false",
         "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
         "ALL_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost"}
# Per snippet: what its run hands back (an expression over the snippet's variables).
PROBES = {
    "openai": "dict(texts=texts, one=one, vectors=vectors, "
              "unpacked=[u.tolist() for u in unpacked], short=short, from_ids=from_ids, "
              "served=served, retrieved=minilm.id)",
    "openai-chat": "dict(content=reply.choices[0].message.content, streamed=streamed, "
                   "finish=reply.choices[0].finish_reason)",
    "openai-batches": "dict(texts=texts, vectors=vectors, status=batch.status, "
                      "counts=batch.request_counts.model_dump(), "
                      "lines=len(file_response.text.splitlines()))",
    "langchain": "dict(texts=texts, vectors=vectors, query=query, answer=answer, "
                 "query_text=query_text, best=[[d.page_content, d.metadata['relevance_score']]"
                 " for d in best], indexed=len(index), chunks=[chunks[i] for i in (0, 999)], "
                 "index=[index[i] for i in (0, 999)])",
    "llamaindex": "dict(texts=texts, vectors=vectors, query=query, answer=answer, "
                  "query_text=query_text, best=[[n.node.get_content(), n.score] for n in best])",
    "haystack": "dict(texts=texts, vectors=vectors, query=query, query_text=query_text, "
                "best=[[d.content, d.score] for d in best])",
    "litellm": "dict(texts=texts, vectors=vectors, answer=answer, query_text=query_text, "
               "ranked=[[[r['index'], r['relevance_score']] for r in response.results] "
               "for response in (ranked, via_jina, via_tei)])",
    "chroma": "dict(count=collection.count(), hits=hits['ids'][0], "
              "hit_documents=hits['documents'][0], sample={k: v.tolist() if k == 'embeddings' "
              "else v for k, v in collection.get(ids=[str(i) for i in (0, 1, 500, 998, 999)], "
              "include=['embeddings', 'documents']).items() "
              "if k in ('ids', 'embeddings', 'documents')})",
    "http": "dict(texts=texts, query_text=query_text, ranked=ranked, "
            "tei_vectors=tei_vectors, tei_ranked=tei_ranked, tei_labels=tei_labels)",
    "celery": "dict(texts=texts, vectors=vectors, query_text=query_text, best=best)",
    "huggingface-hub": "dict(texts=texts, vectors=vectors.tolist(), query_text=query_text, "
                       "similarity=similarity, top=[top.label, top.score])",
    "litellm-huggingface": "dict(texts=texts, vectors=vectors, query_text=query_text, "
                           "ranked=[[r['index'], r['relevance_score']] for r in ranked.results])",
    "images": "dict(png=base64.b64encode(png).decode(), vectors=vectors, "
              "from_messages=from_messages)",
    "cohere-embed": "dict(texts=texts, vectors=vectors, int8=int8, ubinary=ubinary, "
                    "lc_vectors=lc_vectors, query_text=query_text, lc_query=lc_query, "
                    "litellm_vectors=litellm_vectors)",
}
# Clients written for a one-model server (TEI's): they name no model, so they run against a
# gateway of the module's own over the same workers, with MiniLM in SHOAL_DEFAULT_MODELS (its
# reranker and classifier: the only ones workers serve). huggingface_hub refuses every URL
# while HF_HUB_OFFLINE is set, a local one too.
DEFAULT_MODEL_SNIPPETS = {"huggingface-hub", "litellm-huggingface"}
SNIPPET_ENV = {"huggingface-hub": {"HF_HUB_OFFLINE": "0"}}
IN_PROCESS = {"celery"}  # needs shoal itself (tasks.client): runs in this venv, in this process
CHAT_PROMPT = "Name a colour."


@cache
def snippets() -> dict[str, str]:
    return dict(SNIPPET.findall(DOC.read_text()))


def as_tested(code: str, url: str) -> str:
    """The snippet with the test stack's URL and models in place of the docs'."""
    if "SHOAL_URL" in code:
        assert code.count(DOC_URL) == 1, f"a snippet must set {DOC_URL} once"
        code = code.replace(DOC_URL, f"SHOAL_URL = {url!r}")
    for doc_model, test_model in DOC_MODELS.items():
        code = code.replace(doc_model, test_model)
    return code


class Runs:
    """The snippets' subprocesses, two at a time (the longest first: chroma's embeds 1,000
    documents); `result(name)` waits for one."""

    LANES = 2  # this machine's cores: more at once only makes each slower

    def __init__(self, url: str, work: Path, urls: dict[str, str] | None = None) -> None:
        if not CLIENTS_PYTHON.exists():
            raise AssertionError(f"{CLIENTS_PYTHON} is missing: `make clients` builds it")
        self.url, self.work = url, work
        self.urls = urls or {}  # a snippet's own gateway, where it has one
        self.env = {**os.environ, **QUIET}
        self.procs: list[subprocess.Popen[str]] = []
        self.closed = False
        self.pool = ThreadPoolExecutor(self.LANES, thread_name_prefix="snippet")
        names = sorted((n for n in snippets() if n not in IN_PROCESS), key=lambda n: n != "chroma")
        self.futures = {name: self.pool.submit(self._run, name) for name in names}

    def _run(self, name: str) -> tuple[int, str, str]:
        spec = self.work / f"{name}.json"
        spec.write_text(json.dumps([{"name": name, "code": as_tested(snippets()[name],
                                                               self.urls.get(name, self.url)),
                                     "probe": PROBES[name]}]))
        # cwd: a folder of its own, where nothing of the repository shadows a client.
        proc = subprocess.Popen([str(CLIENTS_PYTHON), str(RUNNER), str(spec)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**self.env, **SNIPPET_ENV.get(name, {})},
                                cwd=str(self.work))
        self.procs.append(proc)
        if self.closed:
            proc.kill()
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return proc.returncode, out, err

    def result(self, name: str) -> dict[str, Any]:
        code, out, err = self.futures[name].result()
        assert code == 0 and out, f"{name}: exit {code}\n{err[-4000:]}"
        run = json.loads(out)[name]
        assert "error" not in run, f"docs/clients.md snippet {name!r} failed:\n{run['error']}"
        return run

    def in_process(self, name: str) -> dict[str, Any]:
        printed = io.StringIO()
        namespace: dict[str, Any] = {"__name__": "__main__"}
        with contextlib.redirect_stdout(printed):
            exec(compile(as_tested(snippets()[name], self.url), f"docs/clients.md:{name}",
                         "exec"), namespace)
            probe = eval(PROBES[name], namespace)
        return {"probe": json.loads(json.dumps(probe)), "printed": printed.getvalue()}

    def close(self) -> None:
        self.closed = True
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def runs(families, tmp_path_factory):
    port = free_port()
    default = families.stack.gateway("gateway-clients-default", port, None,
                                     SHOAL_DEFAULT_MODELS=MINILM)
    url = f"http://127.0.0.1:{port}"
    # Its reranker is the only one workers serve: known once their pool states arrived.
    wait_for(lambda: _answers(f"{url}/rerank", {"query": "q", "texts": ["a"]}), 60,
             "the default-model gateway to hear which models the workers serve")
    runs = Runs(families.url, tmp_path_factory.mktemp("client-snippets"),
                urls=dict.fromkeys(DEFAULT_MODEL_SNIPPETS, url))
    yield runs
    runs.close()
    default.stop()


def _answers(url: str, body: dict[str, Any]) -> bool:
    try:
        return httpx.post(url, json=body, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def minilm():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(MINILM_DIR), device="cpu")


def assert_same_vectors(got, want) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    cosines = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1)
                                          * np.linalg.norm(want, axis=1))
    assert cosines.min() >= 0.99999, cosines


def scores(url: str, query: str, texts: list[str]) -> list[float]:
    """/v1/score's score of each text, by index."""
    r = httpx.post(f"{url}/v1/score/{RERANKER}", timeout=60,
                   json={"query": query, "items": [{"text": t} for t in texts]})
    assert r.status_code == 200, r.text
    by_index = {row["index"]: row["score"] for row in r.json()["results"]}
    return [by_index[i] for i in range(len(texts))]


def assert_ranked(url: str, query: str, texts: list[str], got: list[tuple[int, float]],
                  top_n: int) -> None:
    """`got` (index, score) pairs are /v1/score's best `top_n`, best first, with its scores."""
    want = scores(url, query, texts)
    order = sorted(range(len(texts)), key=lambda i: -want[i])[:top_n]
    assert [index for index, _ in got] == order, (got, want)
    for index, score in got:
        assert score == pytest.approx(want[index], abs=1e-6)


def by_text(texts: list[str], best: list[list]) -> list[tuple[int, float]]:
    return [(texts.index(text), score) for text, score in best]


def chat_reference(url: str) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": LLAMA, "messages": [{"role": "user", "content": CHAT_PROMPT}],
        "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_every_python_block_of_the_page_is_tested():
    text = DOC.read_text()
    assert text.count("```python") == len(snippets()) > 0, \
        "every ```python block in docs/clients.md needs a <!-- test: NAME --> line above it"
    assert set(snippets()) == set(PROBES), "a snippet without a probe here, or a stale probe"
    assert "clients.md" in (REPO / "README.md").read_text()


def test_openai(runs, minilm):
    run = runs.result("openai")
    got, printed = run["probe"], run["printed"]
    want = minilm.encode(got["texts"])
    assert_same_vectors([got["one"]], want[:1])
    assert_same_vectors(got["vectors"], want)
    assert_same_vectors(got["unpacked"], want)
    head = want[:1, :64] / np.linalg.norm(want[:1, :64], axis=1, keepdims=True)
    assert_same_vectors([got["short"]], head)
    assert_same_vectors([got["from_ids"]], minilm.encode(["hello"]))
    assert MINILM in got["served"] and got["retrieved"] == MINILM
    lines = printed.splitlines()
    assert lines[0].startswith("404 ") and lines[1].startswith("400 "), printed


def test_openai_chat(runs):
    got = runs.result("openai-chat")["probe"]
    assert got["content"] == got["streamed"] == chat_reference(runs.url)
    assert got["finish"] in ("stop", "length")


def test_openai_batches(runs, minilm):
    """The openai SDK's own batch example: its output file holds one answer per line, each
    the vector /v1/embeddings gives."""
    got = runs.result("openai-batches")["probe"]
    assert got["status"] == "completed"
    count = len(got["texts"])
    assert got["counts"] == {"total": count, "completed": count, "failed": 0}
    assert got["lines"] == count
    assert_same_vectors(got["vectors"], minilm.encode(got["texts"]))


@pytest.mark.parametrize("framework", ["langchain", "llamaindex", "haystack"])
def test_framework(runs, minilm, framework):
    """Documents and a query embedded, a chat answer (Haystack's snippet has none), and
    the documents reranked, each as the framework does it."""
    got = runs.result(framework)["probe"]
    assert_same_vectors(got["vectors"], minilm.encode(got["texts"]))
    assert_same_vectors([got["query"]], minilm.encode([got["query_text"]]))
    if framework != "haystack":
        assert got["answer"] == chat_reference(runs.url)
    if framework == "langchain":  # an indexing call of 1,000 long chunks, deadline unset
        assert got["indexed"] == 1000
        assert_same_vectors(got["index"], minilm.encode(got["chunks"]))
    assert_ranked(runs.url, got["query_text"], got["texts"],
                  by_text(got["texts"], got["best"]), top_n=2)


def test_litellm(runs, minilm):
    got = runs.result("litellm")["probe"]
    assert_same_vectors(got["vectors"], minilm.encode(got["texts"]))
    assert got["answer"] == chat_reference(runs.url)
    cohere, jina, tei = ([tuple(pair) for pair in pairs] for pairs in got["ranked"])
    assert_ranked(runs.url, got["query_text"], got["texts"], cohere, top_n=2)
    assert_ranked(runs.url, got["query_text"], got["texts"], jina, top_n=2)
    assert_ranked(runs.url, got["query_text"], got["texts"], tei, top_n=len(got["texts"]))


def test_chroma_adds_1000_documents_in_one_request(runs, minilm):
    got = runs.result("chroma")["probe"]
    assert got["count"] == 1000
    # A sample of what chroma stored, against sentence-transformers (a reference for all
    # 1,000 would cost this 2-core machine a minute).
    sample = got["sample"]
    assert sorted(sample["ids"], key=int) == ["0", "1", "500", "998", "999"]
    assert_same_vectors(sample["embeddings"], minilm.encode(sample["documents"]))
    # The hits are the documents nearest the query, nearest first.
    query = minilm.encode(["Which room is project 5's meeting in?"])[0]
    similarity = minilm.encode(got["hit_documents"]) @ query
    assert len(got["hits"]) == 3
    assert all(a >= b - 1e-5 for a, b in itertools.pairwise(similarity)), similarity


def test_http_rerank_and_tei_routes(runs, minilm):
    got = runs.result("http")["probe"]
    texts, query = got["texts"], got["query_text"]
    assert_ranked(runs.url, query, texts,
                  [(r["index"], r["relevance_score"]) for r in got["ranked"]], top_n=2)
    assert [r["document"]["text"] for r in got["ranked"]] == \
        [texts[r["index"]] for r in got["ranked"]]
    assert_same_vectors(got["tei_vectors"], minilm.encode(texts))
    assert_ranked(runs.url, query, texts,
                  [(r["index"], r["score"]) for r in got["tei_ranked"]], top_n=len(texts))
    r = httpx.post(f"{runs.url}/v1/classify/{SENTIMENT}", timeout=60,
                   json={"items": [{"text": "What a lovely day!"}]})
    assert r.status_code == 200, r.text
    want = sorted(r.json()["labels"][0], key=lambda entry: -entry["score"])
    assert [entry["label"] for entry in got["tei_labels"]] == [e["label"] for e in want]
    for entry, expected in zip(got["tei_labels"], want, strict=True):
        assert entry["score"] == pytest.approx(expected["score"], abs=1e-6)


def test_celery(runs, minilm):
    run = runs.in_process("celery")
    got = run["probe"]
    assert_same_vectors(got["vectors"], minilm.encode(got["texts"]))
    assert_ranked(runs.url, got["query_text"], got["texts"],
                  [(r["index"], r["score"]) for r in got["best"]], top_n=len(got["texts"]))
    assert run["printed"].startswith("VALIDATION_ERROR "), run["printed"]


def test_huggingface_hub_inference_client(runs, minilm):
    got = runs.result("huggingface-hub")["probe"]
    want = minilm.encode(got["texts"])
    assert_same_vectors(got["vectors"], want)
    query = minilm.encode([got["query_text"]])[0]
    cosine = want @ query / (np.linalg.norm(want, axis=1) * np.linalg.norm(query))
    assert np.allclose(got["similarity"], cosine, atol=1e-5)
    r = httpx.post(f"{runs.url}/v1/classify/{SENTIMENT}", timeout=60,
                   json={"items": [{"text": "What a lovely day!"}]})
    assert r.status_code == 200, r.text
    best = max(r.json()["labels"][0], key=lambda entry: entry["score"])
    assert got["top"][0] == best["label"]
    assert got["top"][1] == pytest.approx(best["score"], abs=1e-6)


def test_litellm_huggingface_provider(runs, minilm):
    got = runs.result("litellm-huggingface")["probe"]
    assert_same_vectors(got["vectors"], minilm.encode(got["texts"]))
    assert_ranked(runs.url, got["query_text"], got["texts"],
                  [tuple(pair) for pair in got["ranked"]], top_n=len(got["texts"]))


def test_images_on_v1_embeddings(runs):
    """A data URI and vLLM's messages embed the image as /v1/encode does its bytes."""
    got = runs.result("images")["probe"]
    png = base64.b64decode(got["png"])
    r = httpx.post(f"{runs.url}/v1/encode/{CLIP}", timeout=60,
                   content=msgpack.packb({"items": [{"image": png}, {"text": "a red square"}]}),
                   headers={"content-type": "application/msgpack"})
    assert r.status_code == 200, r.text
    want = msgpack.unpackb(r.content)["embeddings"]
    assert_same_vectors(got["vectors"], want)
    assert_same_vectors([got["from_messages"]], want[:1])


def test_cohere_embed(runs, minilm):
    """Cohere's SDK, LangChain's CohereEmbeddings and litellm's cohere/ provider get
    sentence-transformers' vectors, and Cohere's int8 and ubinary of them."""
    run = runs.result("cohere-embed")
    got, printed = run["probe"], run["printed"]
    want = minilm.encode(got["texts"])
    for vectors in (got["vectors"], got["lc_vectors"], got["litellm_vectors"]):
        assert_same_vectors(vectors, want)
    assert_same_vectors([got["lc_query"]], minilm.encode([got["query_text"]]))
    rows = np.asarray(got["vectors"], dtype=np.float32)
    scale = 127 / np.abs(rows).max(axis=1, keepdims=True)
    assert (np.asarray(got["int8"]) == np.clip(np.rint(rows * scale), -127, 127)).all()
    assert (np.asarray(got["ubinary"]) == np.packbits(rows > 0, axis=1)).all()
    assert printed.startswith("400 ") and "END" in printed, printed
