# kfac_stream — developer entry points. `make help` lists them.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP  := $(VENV)/.installed

.PHONY: help venv test test-slow demo bench clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)  ## create or reuse .venv and install the project with its test extra

test: $(STAMP)  ## run the test suite (CPU)
	$(PY) -m pytest -q -m "not slow" tests

test-slow: $(STAMP)  ## run the slow tests too
	$(PY) -m pytest -q tests

demo: $(STAMP)  ## train a tiny GPT-2 on local text with the callback and print the snapshot
	$(PY) -m kfac_stream.demo --output-dir out/demo

bench: $(STAMP)  ## run the overhead benchmark and write benchmarks/RESULTS.md
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
