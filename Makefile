PY ?= python3.11
# the second interpreter of the test matrix (docs/testing.md): pyenv's 3.12, else one on PATH
PY312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
JAX312 ?= 0.12.0.1
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VENV312 := .venv312
STAMP312 := $(VENV312)/.installed
REPORTS := build/test

.PHONY: test demo notebooks lint venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[demo,test,hf]'
	touch $(STAMP)

# Python 3.12 with the newest JAX in the supported range, without torch (pip's torch on 3.12
# is a multi-GB CUDA build): runs the torch-free tests
$(STAMP312): pyproject.toml
	test -x $(VENV312)/bin/python || $(PY312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q --upgrade pip
	$(VENV312)/bin/pip install -q 'jax==$(JAX312)' 'jaxlib==$(JAX312)' -e '.[demo,test]'
	touch $(STAMP312)

venv: $(STAMP)

NB_STAMP := $(VENV)/.notebook
$(NB_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[notebook]'
	touch $(NB_STAMP)

# Every notebook top to bottom in .venv's Jupyter kernel (`pip install '.[notebook]'`), nothing
# written back; a failing cell stops it. tests/test_notebooks.py runs the same notebooks.
notebooks: $(NB_STAMP)
	$(BIN)/jupyter execute --timeout=600 notebooks/*.ipynb

# Two pytest workers per interpreter (compiling is mostly single-threaded), whole modules per
# worker; each worker drops a module's compiled programs when it ends (tests/conftest.py): one
# process holding every compiled program of the suite crashed inside XLA's CPU compiler.
# Modules go out slowest first (tests/module_seconds.json, see tests/conftest.py), not by count.
PYTEST := -q -n 2 --dist loadfile --no-loadscope-reorder
# JAX's persistent compilation cache, one per interpreter (JAX versions do not share entries),
# emptied at the start of every `make test` / `make demo` so that no run reuses another's
# programs: it serves a program compiled again within the run (each module's programs are
# dropped when it ends; the other worker; the end-to-end tests' subprocesses; the demo's
# dense control compiles the main run's dense and warm-up programs). Every program is kept.
CACHE := $(abspath build/jax-cache)
CACHE_ENV = JAX_COMPILATION_CACHE_DIR=$(CACHE)/$(1) JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
# XLA's CPU code generation (docs/testing.md, "Code generation"; the tests' child processes
# inherit it): each program one LLVM module, since with two workers on two cores splitting it
# for parallel code generation only adds work (results bitwise equal), compiled at LLVM -O0 (the
# same XLA programs, machine code optimised less: float results within ~7e-7 of -O3's).
# tests/test_codegen.py runs a tiny CSA layer and the sharded top-k at XLA's defaults in a child
# process against this run's results; `make demo` and the benchmarks use the defaults.
XLA_TEST := --xla_cpu_parallel_codegen_split_count=1 --xla_backend_optimization_level=0
# jaxlib 0.10.2's CPU compiler without its fusion emitters (the loop emitters instead): the
# interpreted kernels' programs compile ~3x faster; jaxlib 0.12 no longer knows the flag (it
# stops on it), so the 3.11 half only
XLA_TEST311 := $(XLA_TEST) --xla_cpu_use_fusion_emitters=false
# This machine sets PYTHONDONTWRITEBYTECODE=1: no bytecode cache was ever written, so every
# process compiled csa_eqx from source, and under jaxtyping's import hook (which looks for its own
# cache files while a csa_eqx module runs its imports) torch, jax and scipy as well.
unexport PYTHONDONTWRITEBYTECODE
# The halves run one after the other: side by side (four pytest workers on two cores) they
# took ~5 % more CPU and longer in all (docs/testing.md, "One half at a time"); only the two
# virtual environments are built side by side.
test:
	$(MAKE) -j2 $(STAMP) $(STAMP312)
	$(BIN)/ruff check csa_eqx tests benchmarks
	rm -rf $(REPORTS) $(CACHE)/py311 $(CACHE)/py312 && mkdir -p $(REPORTS)
	CSA_EQX_TEST_HALF=py311 XLA_FLAGS="$(XLA_TEST311)" $(call CACHE_ENV,py311) \
		$(BIN)/python -m pytest $(PYTEST) \
		--junitxml=$(REPORTS)/py311.xml
	CSA_EQX_TEST_HALF=py312 XLA_FLAGS="$(XLA_TEST)" $(call CACHE_ENV,py312) \
		$(VENV312)/bin/python -m pytest $(PYTEST) \
		--torch-free --junitxml=$(REPORTS)/py312.xml
	$(BIN)/python tools/test_timing.py $(REPORTS)/py311.xml $(REPORTS)/py312.xml

demo: $(STAMP)
	rm -rf $(CACHE)/demo
	$(call CACHE_ENV,demo) $(BIN)/csa-eqx train --name demo

lint: $(STAMP)
	$(BIN)/ruff check csa_eqx tests benchmarks
	$(BIN)/ruff format --check csa_eqx tests benchmarks

clean:
	rm -rf $(VENV) $(VENV312) $(REPORTS) $(CACHE)
