"""Token-id input through the `openai` SDK, as LangChain's OpenAIEmbeddings sends it by
default: the model's own ids give the vector of their text; ids the model does not have,
empty strings and mixed inputs are the caller's error (4xx), never a failed batch."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from tests.conftest import LLAMA, MINILM, family_dir
from tests.stack import openai_client
from tests.tiny_models import MINILM_DIR

pytestmark = pytest.mark.e2e
HELLO = [101, 7592, 102]  # MiniLM's tokenizer("hello")["input_ids"]


def _vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def test_token_ids_embed_as_their_text(stack):
    client = openai_client(stack.url)
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_DIR))
    texts = ["hello", "The cat sits on the mat."]
    assert tokenizer(texts[0])["input_ids"] == HELLO
    reference = _vectors(client.embeddings.create(model=MINILM, input=texts))
    lists = client.embeddings.create(model=MINILM,
                                     input=[tokenizer(t)["input_ids"] for t in texts])
    one = client.embeddings.create(model=MINILM, input=HELLO)
    assert [d.index for d in lists.data] == [0, 1] and len(one.data) == 1
    for got, want in ((_vectors(lists), reference), (_vectors(one), reference[:1])):
        cosine = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) \
            / np.linalg.norm(want, axis=1)
        assert cosine.min() >= 0.99999, cosine
    assert one.usage.prompt_tokens == 3
    # The native route takes them as items: {"tokens": [...]}.
    native = httpx.post(f"{stack.url}/v1/encode/{MINILM}",
                        json={"items": [{"tokens": HELLO}, {"text": texts[1]}]}, timeout=30)
    assert native.status_code == 200, native.text
    np.testing.assert_allclose(np.array(native.json()["embeddings"], dtype=np.float32),
                               reference, atol=1e-6)


@pytest.mark.parametrize("value,fragment", [
    # The runtime's checks name the item as the caller sent it: input[0], not items[0].
    ([[101, 100257, 102]], "input[0] has token id 100257, but "
                           "sentence-transformers/all-MiniLM-L6-v2's vocabulary has 30522 ids "
                           "(0-30521)"),
    # LangChain's default: OpenAI's tiktoken ids ("hello"), which BERT's range would take.
    ([[15339]], "does not start with [CLS] (101) and end with [SEP] (102)"),
    (["hello", ""], "input[1] is an empty string"),
    ("", "'input' is an empty string"),
    ([[101], []], "input[1] must be a non-empty list of token ids"),
    (["hello", [101]], "input[1] is not a string"),
])
def test_what_the_model_cannot_take_is_a_client_error(stack, value, fragment):
    # 400, OpenAI's status for a bad input: the SDK's BadRequestError.
    with pytest.raises(openai.BadRequestError) as err:
        openai_client(stack.url).embeddings.create(model=MINILM, input=value)
    assert err.value.status_code == 400 and err.value.code == "VALIDATION_ERROR"
    assert fragment in str(err.value)


def test_token_id_prompts_complete_as_their_text(families):
    client = openai_client(families.url)
    tokenizer = AutoTokenizer.from_pretrained(family_dir(LLAMA))
    prompts = ["The cat sits", "hello there"]
    # A text prompt becomes BOS and its ids, no end token (`runtimes.families.prompts`): the same
    # ids
    # as token input complete the same way.
    ids = [[tokenizer.bos_token_id, *tokenizer(p, add_special_tokens=False)["input_ids"]]
           for p in prompts]
    text = client.completions.create(model=LLAMA, prompt=prompts, max_tokens=5, temperature=0)
    tokens = client.completions.create(model=LLAMA, prompt=ids, max_tokens=5, temperature=0)
    one = client.completions.create(model=LLAMA, prompt=ids[0], max_tokens=5, temperature=0)
    assert [c.text for c in tokens.choices] == [c.text for c in text.choices]
    assert one.choices[0].text == text.choices[0].text
    assert tokens.usage.prompt_tokens == text.usage.prompt_tokens == sum(map(len, ids))
