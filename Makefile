# Each target sets up what it needs on a fresh machine: the venv, the CPU build
# of torch (installed first, so nothing pulls a CUDA build) and the extras.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
VLLM_VERSION ?= 0.33.0
# Modules compiled by mypyc (see setup.py): editing one triggers a rebuild.
COMPILED := src/kvtier/pool.py src/kvtier/manager.py src/kvtier/block_table.py src/kvtier/policy/lru.py src/kvtier/policy/arc.py

.PHONY: run test test-compiled test-pure lint typecheck bench venv peers clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(VENV)/.torch: $(BIN)/python
	$(BIN)/pip install torch==$(TORCH_VERSION)
	touch $@

$(VENV)/.deps: $(VENV)/.torch pyproject.toml setup.py $(COMPILED)
	$(BIN)/pip install -e '.[torch,dev]'
	touch $@

venv: $(VENV)/.deps

## The main job: replay the bundled production-trace sample through every policy.
run: venv
	$(BIN)/kvtier replay --policy all

## The whole test suite (what CI runs): lint, types, tests on the compiled
## hot paths and again on the pure-Python fallback.
test: lint typecheck test-compiled test-pure

test-compiled: venv
	$(BIN)/python -m pytest -q

test-pure: venv
	KVTIER_PURE_PYTHON=1 $(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check src tests bench setup.py

typecheck: venv
	$(BIN)/mypy

## Peers for side-by-side benchmarks: vLLM without its CUDA dependencies.
peers: venv
	$(BIN)/pip install --no-deps vllm==$(VLLM_VERSION) openai-harmony uvloop \
	  partial-json-parser xgrammar==0.2.8 apache-tvm-ffi==0.1.11 'llguidance>=1.7,<1.8'
	$(BIN)/pip install -e '.[torch,dev,vllm,bench]'

bench: peers
	$(BIN)/python bench/bookkeeping.py
	$(BIN)/python bench/policies.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
	find src -name '*.so' -delete
