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

test: $(STAMP)
	$(BIN)/ruff check csa_eqx tests benchmarks
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/csa-eqx train --name demo

lint: $(STAMP)
	$(BIN)/ruff check csa_eqx tests benchmarks
	$(BIN)/ruff format --check csa_eqx tests benchmarks

clean:
	rm -rf $(VENV)
