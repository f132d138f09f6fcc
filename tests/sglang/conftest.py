"""One tiny random Llama served by real SGLang servers for the whole run.

The model (hidden 64, 2 layers, 4 heads, 2 KV heads: head_dim 16, which SGLang's CPU path
takes) borrows the MiniLM (BERT) tokenizer like `tests.tiny_lm`: the runtime tokenizes in
the worker and sends token ids, and decodes the ids SGLang returns, so SGLang's own
detokenizer matters only for stop strings. One server generates, one embeds
(`--is-embedding`, last-token pooling); both start together at the beginning of the run.

The generate server runs with the TEST-ONLY fault hook on (`SHOAL_SGLANG_FAULT_CRASH_ON`,
runtimes/sglang/launch.py): a prompt containing POISON kills it.

Without `.venv-sglang` these tests fail (not skip) and say how to build it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from runtimes.sglang.server import missing_python_message, sglang_python
from tests.tiny_lm import CONTEXT, tiny_tokenizer

LLAMA = "test/sglang-llama"
EMBED = "test/sglang-embed"
POISON = "zebra"


def build_llama(out: Path) -> Path:
    tokenizer = tiny_tokenizer(bos=True, chat_template=True)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=CONTEXT, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("sglang") / "llama")


@pytest.fixture(scope="session")
def catalog_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("sglang-catalog")
    entries = {
        "llama": {"id": LLAMA, "adapter": "causal-lm", "runtime": "sglang",
                  "source": {"path": str(llama_dir)}},
        "embed": {"id": EMBED, "adapter": "dense", "runtime": "sglang", "dims": 64,
                  "pooling": "lasttoken", "normalize": True,
                  "source": {"path": str(llama_dir)}},
    }
    for name, entry in entries.items():
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(entry))
    return directory


@pytest.fixture(scope="session")
def runtime(catalog_dir: Path):
    python = sglang_python()
    if not python.exists():
        pytest.fail(missing_python_message(python), pytrace=False)
    from runtimes.sglang import SGLangRuntime

    started = time.monotonic()
    rt = SGLangRuntime(catalog_dir, [], device="cpu", start_timeout=240,
                       env={"SHOAL_SGLANG_FAULT_CRASH_ON": POISON})
    errors: list[BaseException] = []

    def load(model: str) -> None:
        try:
            rt.load(model)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(m,)) for m in (LLAMA, EMBED)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        rt.close()
        raise errors[0]
    print(f"\nSGLang servers for {LLAMA} and {EMBED} healthy in "
          f"{time.monotonic() - started:.1f}s")
    yield rt
    rt.close()
