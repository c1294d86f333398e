# lmcache-server developer commands.  `make run` and `make test` work on a
# fresh machine with Python 3.11+: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Pinned: an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: setup setup-test system-deps run test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml client/pyproject.toml
	$(BIN)/pip install -q -e ./client -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q "$(TORCH)" -e ./client -e ".[test,dev]"
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

## redis-server, promtool/prometheus, docker-compose: installed with apt-get when missing (as root).
system-deps:
	bash scripts/system-deps.sh

## Run the daemon on the built-in defaults plus a disk tier in ./.lmcache/spill
## (CPU memory + disk, no Redis; tcp://127.0.0.1:65432).  Extra flags: make run ARGS="...".
run: setup
	$(BIN)/lmcache-server --set local_disk=file://$(CURDIR)/.lmcache/spill --set max_local_disk_size=10GiB $(ARGS)

## Run the test suite against real daemon processes (and real redis-server, prometheus).
test: setup-test system-deps
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: setup-test
	$(BIN)/ruff check lmcache_server client tests benchmarks
	$(BIN)/mypy lmcache_server client/lmcache_client

bench: setup-test
	$(BIN)/python benchmarks/bench_throughput.py --json bench-results/throughput.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
