# Two entry points, both from a fresh clone on a machine with no API keys:
#   make quickstart   set up, build a RAPTOR tree over docs/ and answer a question
#   make test         set up and run the whole test suite (what .ci/run calls)
#
# torch is pinned and installed FIRST: an unpinned torch (or `pip install -U`) pulls
# gigabytes of CUDA packages; with 2.13.0 already present pip keeps it.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
TORCH  := torch==2.13.0

.PHONY: quickstart test install install-dev lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e .

install-dev: $(BIN)/python
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[dev]'

quickstart: install
	$(BIN)/raptor build docs README.md --glob '*.md' --out .raptor/docs-tree --overwrite
	$(BIN)/raptor inspect .raptor/docs-tree
	$(BIN)/raptor query .raptor/docs-tree "What happens to a cluster that is too long to summarise?" --max-tokens 400

test: install-dev
	sh scripts/ensure-chromium.sh
	$(BIN)/python -m pytest -q

lint: install-dev
	$(BIN)/ruff check raptor_core raptor_llamaindex raptor_langchain tests benchmarks examples
	$(BIN)/lint-imports

bench: install-dev
	$(BIN)/python benchmarks/build.py
	$(BIN)/python benchmarks/query.py
	$(BIN)/python benchmarks/query_load.py
	$(BIN)/python benchmarks/cold_start.py
	$(BIN)/python benchmarks/stores.py
	$(BIN)/python benchmarks/first_query.py
	$(BIN)/python benchmarks/cluster_threads.py
	$(BIN)/python benchmarks/vs_baselines.py
	$(BIN)/python benchmarks/quality.py
	$(BIN)/python benchmarks/incremental.py

clean:
	rm -rf .raptor .pytest_cache .mypy_cache .ruff_cache
