# Quickstart on a fresh machine with Python 3.11:  make run  (toy matrix on CPU)  |  make test  |  make lint
PY ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
# Jobs call `python -m marlflow.<verb>`: put the venv first on PATH so `python` is the venv's.
export PATH := $(BIN):$(PATH)
export HF_HUB_OFFLINE := 1

.PHONY: setup run test lint

# Reinstall only when pyproject.toml is newer than the stamp.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/snakemake --profile profiles/local

test: $(STAMP)
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakemake --lint
	$(BIN)/snakefmt --check Snakefile rules/
