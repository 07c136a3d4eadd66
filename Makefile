# Recompute recipes: `make help` lists the targets. Variables: SIZE, SWEEP, DIR, BUDGET, ARGS.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SIZE ?= tiny
SWEEP ?= standard_attn
DIR ?= $(shell ls -dt multirun/*/* 2>/dev/null | head -1)
BUDGET ?= 80
ARGS ?=
# make test's pytest workers (pytest-xdist): auto = one per core; 1 runs the suite in one process.
TEST_WORKERS ?= auto
# A Python >= 3.12 (megatron-core 0.17+ needs it): PYTHON=..., else the first of python3.12, python3 on
# PATH, then pyenv's 3.12.x, 3.13.x, ... that actually runs and is >= 3.12 (pyenv shims may not).
PYTHON ?= $(shell for p in python3.12 python3 $$(for v in $$(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9]|[2-9][0-9])(\.|$$)' | sort -V); do echo "$$(pyenv prefix $$v)/bin/python3"; done); do \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { command -v $$p; exit; }; done)

.PHONY: help install run test test-gpu lint check-data docs sweep report advise estimate bench data clean

help: ## Show this menu
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-11s\033[0m %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.12 found; set PYTHON=/path/to/python3.12"; exit 1; }
	@echo "using $(PYTHON) ($$($(PYTHON) --version))"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed ## Build .venv with Python >= 3.12 and the pinned dependencies

run: install ## Main job: a small recompute comparison (CPU without a GPU); prints a table, writes multirun/
	$(PY) train.py -m size=$(SIZE) attention=unfused recompute=none,control,selective/core_attn,selective/mlp,full $(ARGS)

test: install ## Run the test suite on the CPU (a GPU is hidden) on every core; TEST_WORKERS=1 for one process
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

test-gpu: install ## Run the GPU-marked tests on this machine's GPU (make test runs the suite on the CPU)
	RECIPES_TEST_GPU=1 $(PY) -m pytest -q -m gpu -n 0 $(ARGS)

lint: install ## ruff check (settings in pyproject.toml)
	$(PY) -m ruff check .

check-data: install ## Re-check the GPU evidence (checks/), regenerate-check its tables, the generated docs, every doc reference
	$(PY) -m pytest -q checks
	$(PY) tools/evidence.py tables --check
	$(PY) tools/compat_table.py --check
	$(PY) tools/recipes_table.py --check
	$(PY) tools/check_links.py

docs: install ## Regenerate the generated docs (docs/compatibility.md, docs/recipes.md)
	$(PY) tools/compat_table.py
	$(PY) tools/recipes_table.py

sweep: install ## A versioned sweep: make sweep SWEEP=moe [SIZE=h200] [ARGS=...]
	$(PY) train.py -m sweep=$(SWEEP) size=$(SIZE) $(ARGS)

report: install ## Table, CSV and plot of a sweep: make report [DIR=multirun/...]
	$(PY) -m recipes report $(DIR)

advise: install ## The guide's choice for a budget: make advise [DIR=...] BUDGET=80
	$(PY) -m recipes advise $(DIR) --budget-gib $(BUDGET)

estimate: install ## Predicted memory per rank, no run: make estimate ARGS="model=moe size=h200 --all --budget-gib 80"
	$(PY) -m recipes estimate $(ARGS)

data: install ## Real text without a download: Python stdlib sources -> data/stdlib_text_document (.bin/.idx)
	$(PY) -m recipes preprocess --stdlib --output-prefix data/stdlib --append-eod

bench: install ## Step speed per family (tokens/s, MFU, recompute overhead vs ideal): make bench SIZE=h200
	$(PY) benchmarks/bench_mfu.py --size $(SIZE) $(ARGS)

clean: ## Remove outputs/ and multirun/ (results of earlier runs)
	rm -rf outputs multirun
