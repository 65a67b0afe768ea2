# sky-flower: `make run` (main job on the embedded digits data), `make test` (everything,
# what CI runs), `make test-fast` (lint, unit and in-process protocol tests: no Ray, no
# SuperLink, no `slow` extra seeds).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: install run test test-fast lint format clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build from this disk; a looser pin pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(PY) -m sky_flower.run $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests

test-fast: lint
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests -m "not simulation and not deployment and not slow"

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .ruff_cache .hypothesis
