# sky-flower: `make run` (main job on the embedded digits data), `make test` (what CI runs:
# lint, the in-process tests, then one simulation-engine / SuperLink run per transport),
# `make test-fast` (lint and the in-process tests: no Ray, no SuperLink), `make test-all`
# (`make test` plus the `slow` tier: more seeds and (transport, fault) pairs of the chaos
# tests, and the plain FedAvg example under `flwr run`; CI need not run it).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=
PYTEST_ARGS ?=
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
# The tests without Ray or a SuperLink run on pytest-xdist workers (one torch thread each,
# tests/conftest.py); `make test XDIST=` runs them in one process. The Flower simulation
# (Ray) and deployment tests always run in one process, one after another: a Ray test
# fails if another test's Ray process appears (tests/conftest.py, no_leftover_processes).
XDIST  ?= -n 2
NO_RAY := not simulation and not deployment
RAY    := simulation or deployment
# the engine call collects only the files that mark a test `simulation` or `deployment`
# (collecting all ~70 test modules, each importing torch, Flower, Hypothesis, costs ~15 s);
# `=`: the grep runs only for the targets that use it
ENGINE_FILES = $(shell grep -l -E "mark\.(simulation|deployment)" tests/test_*.py)

.PHONY: install run run-full test test-fast test-all lint format docs clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build from this disk; a looser pin pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# the demo (issue 28: at most 120 s of training after install on a 2-core machine): the
# library's defaults on transport=stream_sequential (conf/transport/: the relay's
# schedule, sequential, one micro-batch per step, on the stream's data plane: Flower
# sets each round up and collects it, activations and gradients travel on its gRPC
# stream). On the relay (the library default, `make run-full`) each hop is a Flower
# message that waits for the simulation engine's 0.1 s polling tick: the same steps and
# accuracy, rounds about 3x as long.
DEMO := transport=stream_sequential
run: install
	$(PY) -m sky_flower.run $(DEMO) $(ARGS)

# the heavier demo: the library's defaults (transport=relay: every hop a Flower message),
# 3 rounds and the benchmark round of a flwr run (7 timed passes per layer, 7 echoes per
# payload, a 64 MiB state probe)
FULL := num_rounds=3 benchmark.repeats=7 benchmark.echo_repeats=7 benchmark.state_probe_mb=64
run-full: install
	$(PY) -m sky_flower.run $(FULL) $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# docs/configuration.md is generated from the settings' own metadata (sky_flower/docs_config.py);
# tests/test_docs.py fails when it is stale: run `make docs` after changing a setting.
docs: install
	$(PY) -m sky_flower.docs_config > docs/configuration.md

# Both pytest calls run; the target fails if either fails (pytest's exit 5, "no tests
# collected", is a failure too: each call must select tests).
test: lint
	@rc=0; \
	$(PYTEST) $(XDIST) $(PYTEST_ARGS) tests -m "$(NO_RAY) and not slow" || rc=1; \
	$(PYTEST) $(PYTEST_ARGS) $(ENGINE_FILES) -m "($(RAY)) and not slow" || rc=1; \
	exit $$rc

test-fast: lint
	$(PYTEST) $(XDIST) $(PYTEST_ARGS) tests -m "$(NO_RAY) and not slow"

test-all: lint
	@rc=0; export SKY_TEST_ALL=1; \
	$(PYTEST) $(XDIST) $(PYTEST_ARGS) tests -m "$(NO_RAY)" || rc=1; \
	$(PYTEST) $(PYTEST_ARGS) $(ENGINE_FILES) -m "$(RAY)" || rc=1; \
	exit $$rc

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .ruff_cache .hypothesis
