# shoal — the two commands a newcomer needs:
#   make run    install, start RabbitMQ if needed, run gateway + worker + Flower
#   make test   install, start RabbitMQ if needed, run the test suite
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# Offline unless the caller says otherwise (HF_HUB_OFFLINE=0 make run: hub models download).
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= $(HF_HUB_OFFLINE)
export TOKENIZERS_PARALLELISM := false

.PHONY: install services run test lint bench bench-peers clean sglang clients faults gpu-check gpu-bundle stress

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

services:
	./infra/ensure-services.sh

run: install services
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/honcho start

test: install services sglang clients
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest

# The timing-sensitive test modules 5 times in a row beside 2 busy loops (ROUNDS, BUSY).
stress: install services
	./infra/stress-tests.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

bench: install services
	$(BIN)/python -m bench.e2e --start-stack

# The PyTorch runtime on a CUDA device (bench/gpu_check.py, under 8 minutes): MiniLM and
# bge-small/-base shapes in fp32 and bf16, in process and through the runtime process;
# without a GPU it says so and exits 0. A GPU machine needs a CUDA build of torch in the
# venv (TORCH_SPEC with PyTorch's CUDA index, see docs/runtimes.md).
# GPU_CHECK_ARGS="--stack ..." adds the whole stack (RabbitMQ + Redis from `make gpu-bundle`'s
# debs, gateway, worker, runtime; bench/gpu_stack.py). A lent GPU host has no network and no
# venv: there the entry is `bash infra/gpu-host/check.sh` (everything, unattended), with
# .gpu-bundle carried; docs/runtimes.md, "On a GPU host".
GPU_CHECK_ARGS ?= --json bench/out/gpu-check.json
gpu-check: install
	$(BIN)/python -m bench.gpu_check $(GPU_CHECK_ARGS)

# What a GPU host without network needs for the check above, made here (~41 MiB, ignored):
# RabbitMQ/Erlang/Redis .debs (apt-get download), cp312 wheels of shoal's dependencies the
# GPU image lacks, MiniLM's config and tokenizer (infra/gpu-host/bundle.sh).
gpu-bundle:
	./infra/gpu-host/bundle.sh

# Fault drills under load (as root: network namespaces, a private RabbitMQ node, a private
# 3-node cluster; ~25 min in all): lost, answered twice, p99 during the fault, recovery.
# What they showed: docs/operations.md. tests/e2e/test_netns_faults.py runs the first, small.
FAULTS_ARGS ?= --runs 3
faults: install services
	$(BIN)/python -m bench.faults --scenario worker-link-cut $(FAULTS_ARGS) --json bench/out/faults-link-cut.json
	$(BIN)/python -m bench.faults --scenario worker-kill $(FAULTS_ARGS) --json bench/out/faults-kill.json
	$(BIN)/python -m bench.faults --scenario broker-restart $(FAULTS_ARGS) --json bench/out/faults-broker-restart.json
	$(BIN)/python -m bench.faults --scenario broker-node-stop $(FAULTS_ARGS) --json bench/out/faults-node-stop.json

# shoal against a peer server (Infinity), same weights, texts and load: bench/peers.py.
# Infinity lives in its own venv (its pins clash with shoal's transformers 5), torch first
# so nothing pulls a CUDA build; its optimum extra is its ONNX Runtime engine (issue 27).
# PEERS_ARGS: e.g. "--clients 1,8 --duration 3 --rounds 1 --systems shoal,infinity".
PEERS_VENV    := .venv-peers
INFINITY_SPEC ?= infinity-emb[server,torch,optimum]==0.0.78
PEERS_ARGS    ?=

$(PEERS_VENV)/.installed: bench/peers-constraints.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(PEERS_VENV)/bin/pip install -q -c bench/peers-constraints.txt "$(TORCH_SPEC)" "$(INFINITY_SPEC)"
	$(PEERS_VENV)/bin/python -c "import torch, sys; sys.exit('.venv-peers: torch ' + torch.__version__ + ' is a CUDA build') if torch.version.cuda else print('.venv-peers: torch', torch.__version__, 'cuda', torch.version.cuda)"
	touch $@

bench-peers: install services $(PEERS_VENV)/.installed
	$(BIN)/python -m bench.peers $(PEERS_ARGS)

# The SGLang runtime (runtimes/sglang, docs/runtimes.md) runs SGLang's server from its own venv:
# sglang 0.5.23 pins torch 2.14.1 and transformers 5.19.0, which clash with shoal's runtime.
# No CPU build of sglang is published: torch + torchvision first, then sglang's non-CUDA
# dependencies held by the known-good freeze, then sglang itself without dependencies.
# On CPU, runtimes/sglang/cpu_kernel_stub stands in for sgl-kernel (import-only).
# About 4 minutes and 7 GB on a clean machine; `make test` builds it (tests/sglang).
SGLANG_VENV := .venv-sglang
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_REQS := runtimes/sglang/requirements-cpu.txt runtimes/sglang/constraints-cpu.txt

$(SGLANG_VENV)/.installed: $(SGLANG_REQS)
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/pip install -q torch==2.14.1 torchvision==0.29.1
	$(SGLANG_VENV)/bin/pip install -q -c runtimes/sglang/constraints-cpu.txt -r runtimes/sglang/requirements-cpu.txt
	$(SGLANG_VENV)/bin/pip install -q --no-deps "$(SGLANG_SPEC)"
	PYTHONPATH=runtimes/sglang/cpu_kernel_stub SGLANG_USE_CPU_ENGINE=1 $(SGLANG_VENV)/bin/python -c "import sglang, torch; print('.venv-sglang: sglang', sglang.__version__, 'torch', torch.__version__)"
	touch $@

sglang: $(SGLANG_VENV)/.installed

# The client SDKs and frameworks docs/clients.md shows (openai, LangChain, LlamaIndex,
# Haystack, litellm, chroma), whose snippets tests/e2e/test_clients.py runs as written: in
# their own venv, so their pins (openai, chromadb's onnxruntime, litellm's tokenizers) never
# move shoal's. Every version exact (tests/clients/requirements.txt); no torch. ~40 s, ~1 GB.
CLIENTS_VENV := .venv-clients

$(CLIENTS_VENV)/.installed: tests/clients/requirements.txt
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install -q --upgrade pip
	$(CLIENTS_VENV)/bin/pip install -q -r tests/clients/requirements.txt
	$(CLIENTS_VENV)/bin/python -c "import importlib.util as u, sys; sys.exit('.venv-clients: torch got in') if u.find_spec('torch') else print('.venv-clients: ready')"
	touch $@

clients: $(CLIENTS_VENV)/.installed

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(CLIENTS_VENV) .pytest_cache .ruff_cache
