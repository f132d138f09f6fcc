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

.PHONY: install services run test lint bench clean

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

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
