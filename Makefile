# Each target sets up what it needs on a fresh machine: the venv, the CPU build
# of torch (installed first, so nothing pulls a CUDA build), the extras and the
# Debian packages.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test lint typecheck bench venv apt clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

$(VENV)/.torch: $(BIN)/python
	$(BIN)/pip install torch==$(TORCH_VERSION)
	touch $@

$(VENV)/.deps: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install -e '.[torch,dev]'
	touch $@

venv: $(VENV)/.deps

apt:
	@command -v redis-server >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server; }

## The main job.
run: venv
	$(BIN)/kvtier info

## The whole test suite (what CI runs).
test: venv
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check src tests bench

typecheck: venv
	$(BIN)/mypy

bench: venv
	$(BIN)/pip install --no-deps vllm==0.33.0
	$(BIN)/pip install -e '.[vllm,bench]'
	$(BIN)/python bench/bookkeeping.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
