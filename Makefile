# Set-up and everyday commands. Everything installs into .venv; torch is pinned by constraints.txt
# to the CPU build so that no step ever downloads a CUDA build.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/pip install -q -c constraints.txt
EXTRAS  ?= test,test-demo,demo,viz,models,hf,check,onnx

.PHONY: help setup check test test-slow test-all demo bench bench-quick clean

help:
	@echo "make test        set up .venv and run the default test tier"
	@echo "make check       lint (ruff check), formatting (ruff format --check) and types (mypy)"
	@echo "make demo        set up .venv and run 'multihead demo'"
	@echo "make test-slow   the opt-in slow tier"
	@echo "make bench       the full benchmark suite; make bench-quick for a short one"

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Re-install when the project's requirements change.
$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(PIP) torch==2.13.0
	$(PIP) -e ".[$(EXTRAS)]"
	touch $@

setup: $(VENV)/.installed

# The habits: lint, formatting and types (configured in pyproject.toml).
LINTED  := src tests benchmarks examples

check: setup
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

# The default tier runs the habits first: a lint, format or type error fails the tests.
test: setup check
	$(BIN)/python -m pytest -m "not slow"

test-slow: setup
	$(BIN)/python -m pytest -m slow

test-all: setup
	$(BIN)/python -m pytest

demo: setup
	$(BIN)/multihead demo

bench: setup
	$(BIN)/pip install -q -c constraints.txt -e ".[bench]"
	$(BIN)/python benchmarks/run_all.py

bench-quick: setup
	$(BIN)/python benchmarks/run_all.py --quick

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
