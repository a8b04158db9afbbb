PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[demo,test]'
	touch $(STAMP)

venv: $(STAMP)

# The suite runs in two processes: one process holding every compiled program of the whole
# suite crashed inside XLA's CPU compiler (segfault) late in a run on the 2-core machine.
test: $(STAMP)
	$(BIN)/ruff check csa_eqx tests benchmarks
	$(BIN)/python -m pytest -q --durations=15 tests/test_[a-l]*.py
	$(BIN)/python -m pytest -q --durations=15 tests/test_[m-z]*.py

demo: $(STAMP)
	$(BIN)/csa-eqx train --name demo

lint: $(STAMP)
	$(BIN)/ruff check csa_eqx tests benchmarks
	$(BIN)/ruff format --check csa_eqx tests benchmarks

clean:
	rm -rf $(VENV)
