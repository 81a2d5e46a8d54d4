# Two entry points, both working on a fresh machine:
#   make run   set up, then embed example sentences with the default model
#   make test  set up with the test extras, then ruff, mypy, the layering contract and the tests
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; on a GPU machine install the CUDA build of your choice first.
TORCH ?= torch==2.13.0

.PHONY: run test lint setup setup-test

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.run-deps: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e '.[model,parquet]'
	touch $@

$(VENV)/.test-deps: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e '.[model,parquet,test]'
	touch $@

setup: $(VENV)/.run-deps
setup-test: $(VENV)/.test-deps

run: setup
	$(VENV)/bin/vecpool embed

lint: setup-test
	$(VENV)/bin/ruff check vecpool tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint
	$(VENV)/bin/pytest -q
