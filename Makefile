# sky-flower: `make run` (main job on the embedded digits data), `make test` (what CI runs:
# lint, the in-process tests, then one simulation-engine / SuperLink run per transport),
# `make test-fast` (lint and the in-process tests: no Ray, no SuperLink, no process of
# their own, no real timeout waited out), `make test-all` (`make test` plus the `slow`
# tier: more seeds and (transport, fault) pairs of the chaos tests, and the plain FedAvg
# example under `flwr run`; CI need not run it).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=
PYTEST_ARGS ?=
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
# The tests without Ray or a SuperLink run on pytest-xdist workers (one torch thread each,
# tests/conftest.py); `make test XDIST=` runs them in one process. The Flower simulation
# (Ray) tests run in one process, one after another: a Ray test fails if another test's
# Ray process appears (tests/conftest.py, no_leftover_processes); the deployment
# (SuperLink) tests run beside them in a second process (ENGINE below).
XDIST  ?= -n 2
NO_RAY := not simulation and not deployment
# the engine calls collect only the files that mark a test `simulation` (Ray) or
# `deployment` (SuperLink) (collecting all ~70 test modules, each importing torch,
# Flower, Hypothesis, costs ~15 s); `=`: the grep runs only for the targets that use it
SIM_FILES    = $(shell grep -l "mark\.simulation" tests/test_*.py)
DEPLOY_FILES = $(shell grep -l "mark\.deployment" tests/test_*.py)
# Every test process (xdist workers, the forkserver, Ray workers, ClientApp processes)
# reuses compiled bytecode and pytest's rewritten test modules instead of compiling
# sky_flower (~30k lines) and rewriting ~240 modules again, even where the environment
# sets PYTHONDONTWRITEBYTECODE (this machine's does).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install run run-full run-lora test test-fast test-all lint format docs clean

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
# accuracy, rounds about 3x as long. Stage sessions (one set-up message per stage for
# the whole run) hold a simulation worker per stage of every pipeline: 0.4 CPUs per
# node gives the engine 5 workers on 2 cores, the edge4 plan's 5 stages.
DEMO := transport=stream_sequential simulation.num_cpus_per_node=0.4
run: install
	$(PY) -m sky_flower.run $(DEMO) $(ARGS)

# the heavier demo: the library's defaults (transport=relay: every hop a Flower message),
# 3 rounds and the benchmark round of a flwr run (7 timed passes per layer, 7 echoes per
# payload, a 64 MiB state probe)
FULL := num_rounds=3 benchmark.repeats=7 benchmark.echo_repeats=7 benchmark.state_probe_mb=64
run-full: install
	$(PY) -m sky_flower.run $(FULL) $(ARGS)

# LoRA fine-tuning (examples/lora-app, issue 41): a small Llama, frozen, with LoRA
# adapters, on fleet lora4 (the data owner cannot hold the base model: helpers hold it),
# on a local SuperLink and one SuperNode per node (transport stream). It prints the plan,
# each round's loss and the weights sent per round against full fine-tuning. Not
# --simulation: the simulation runtime makes every SuperNode a data owner (Flower's
# partition-id), leaving no helper, and no lora4 node alone holds the model.
run-lora: install
	$(PY) -m sky_flower.deploy examples/lora-app --fleet lora4 $(ARGS)

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

# The tiers (docs/development.md). `make test-fast` runs IN_PROCESS: no test that starts
# a process of its own (`processes`: CLI subprocesses, forkserver stages; tests/conftest.py
# fails a test that starts one unmarked), waits out a real timeout (`realtime`) or trains
# a whole run whose path a cheaper test covers (`e2e`).
IN_PROCESS := $(NO_RAY) and not slow and not processes and not realtime and not e2e

# The engine tests: the Ray tests one after another (one Ray at a time) and, beside them
# in a second pytest process, the SuperLink tests (no Ray: they mostly wait on SuperNode
# polls and ClientApp start-ups), whose output is printed when both are done. A third
# process beside them (the `processes` and `realtime` tests) made every call slower
# (2 cores) and a Ray test's leftover check time out. $(1): the marker expressions' suffix.
define ENGINE
	log=$$(mktemp); \
	$(PYTEST) $(PYTEST_ARGS) $(DEPLOY_FILES) -m "deployment $(1)" > $$log 2>&1 & dep=$$!; \
	$(PYTEST) $(PYTEST_ARGS) $(SIM_FILES) -m "simulation $(1)" || rc=1; \
	wait $$dep || rc=1; \
	echo "--- the deployment tests (run beside the simulation tests):"; cat $$log; rm -f $$log
endef

# Every pytest call runs; the target fails if any fails (pytest's exit 5, "no tests
# collected", is a failure too: each call must select tests).
test: lint
	@rc=0; \
	$(PYTEST) $(XDIST) $(PYTEST_ARGS) tests -m "$(NO_RAY) and not slow" || rc=1; \
	$(call ENGINE,and not slow); \
	exit $$rc

test-fast: lint
	$(PYTEST) $(XDIST) $(PYTEST_ARGS) tests -m "$(IN_PROCESS)"

test-all: lint
	@rc=0; export SKY_TEST_ALL=1; \
	$(PYTEST) $(XDIST) $(PYTEST_ARGS) tests -m "$(NO_RAY)" || rc=1; \
	$(call ENGINE,); \
	exit $$rc

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .ruff_cache .hypothesis
