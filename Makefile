# shoal — the two commands a newcomer needs:
#   make run    install, start RabbitMQ if needed, run gateway + worker + Flower
#   make test   install, start RabbitMQ if needed, run the test suite
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install services run test lint bench bench-peers clean

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

test: install services
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .

bench: install services
	$(BIN)/python -m bench.e2e --start-stack

# shoal against a peer server (Infinity), same weights, texts and load: bench/peers.py.
# Infinity lives in its own venv (its pins clash with shoal's transformers 5), torch first
# so nothing pulls a CUDA build. PEERS_ARGS: e.g. "--clients 1,8 --duration 3 --rounds 1".
PEERS_VENV    := .venv-peers
INFINITY_SPEC ?= infinity-emb[server,torch]==0.0.78
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

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
