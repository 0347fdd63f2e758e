# Set-up and everyday commands. Everything installs into .venv, from the lock only:
#   constraints.txt       torch, the CPU build that lies on this machine's disk (never a CUDA download)
#   requirements/lock.txt every other package of every extra, and pip, setuptools and uv, with hashes
# pyproject.toml keeps the ranges users install from; `make test-compat` tests both ends of them.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
LOCK    := requirements/lock.txt
# Where the CPU wheel of torch lies (pip finds it through this machine's pip configuration; uv,
# which writes the lock, is told).
TORCH_WHEELS ?= /opt/wheels

.PHONY: help setup setup-triton check test test-slow test-all test-compat compat-newest compat-lowest lock dist demo bench \
        bench-quick clean

help:
	@echo "make test        set up .venv from the lock and run the default test tier"
	@echo "make check       lint (ruff check), formatting (ruff format --check) and types (mypy)"
	@echo "make demo        set up .venv and run 'multihead demo'"
	@echo "make test-slow   the opt-in slow tier"
	@echo "make setup-triton add triton (the Triton backend's interpreter tests on the CPU)"
	@echo "make test-compat the integration tests with the newest and the lowest release in every range"
	@echo "make lock        refresh requirements/lock.txt to the newest releases in pyproject.toml's ranges"
	@echo "make dist        build the sdist and the wheel into dist/"
	@echo "make bench       the full benchmark suite; make bench-quick for a short one"

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Re-install when the project's requirements change. torch first, without its dependencies (they
# are in the lock); then the lock, hash-checked, nothing resolved; then the project itself, built
# by the locked setuptools; `pip check` proves the result consistent.
$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt $(LOCK)
	$(BIN)/pip install -q --no-deps -c constraints.txt torch==2.13.0+cpu
	$(BIN)/pip install -q --require-hashes --no-deps -r $(LOCK)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	touch $@

setup: $(VENV)/.installed

# The lock: every extra and requirements/tools.in, resolved by uv to the newest releases in range,
# with torch fixed by constraints.txt (its own dependencies locked, torch itself not emitted).
# Run it after changing a range in pyproject.toml or requirements/tools.in, or to take new releases;
# then `make test` (and `make test-compat`) before committing the new lock. The lock records the
# digest of its inputs (requirements/inputs.py): a test fails when they change without a new lock.
# triton (the `triton` extra, 285 MB) is locked on its own in requirements/triton.txt and installed
# only by `make setup-triton`: the Triton backend's interpreter tests skip without it.
UV_COMPILE = $(BIN)/uv pip compile pyproject.toml --python-version 3.11 --find-links $(TORCH_WHEELS) \
             -c constraints.txt --no-emit-package torch --quiet --custom-compile-command "make lock"
TRITON_LOCK := requirements/triton.txt

lock: setup
	$(UV_COMPILE) requirements/tools.in --all-extras --no-emit-package triton --generate-hashes --upgrade -o $(LOCK)
	$(UV_COMPILE) --extra triton --no-deps --generate-hashes --upgrade --no-header \
	    -o $(TRITON_LOCK)
	$(BIN)/python requirements/inputs.py --write

# The optional Triton backend's kernels, for its tests through the interpreter on the CPU.
setup-triton: setup
	$(BIN)/pip install -q --require-hashes --no-deps -r $(TRITON_LOCK)

# The habits: lint, formatting and types (configured in pyproject.toml).
LINTED  := src tests benchmarks examples requirements

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

# Compatibility at both ends of pyproject.toml's ranges (not part of `make test`): a virtual
# environment per end, resolved afresh by uv (newest: the newest release in every range; lowest:
# the lowest release of every direct requirement), torch from constraints.txt, then the
# integration tests and the demo's model loading. What was installed is kept in
# requirements/compat/, the record that the ranges passed (tests/test_setup.py reads it).
COMPAT_EXTRAS := --extra test --extra test-demo --extra demo --extra viz --extra models --extra hf --extra onnx
COMPAT_TESTS  := tests/integrations tests/demo/test_encoder.py tests/demo/test_demo_imports.py tests/demo/test_heatmap.py \
                 tests/demo/test_browser.py
RESOLUTION_newest := highest
RESOLUTION_lowest := lowest-direct

test-compat: compat-newest compat-lowest

compat-newest compat-lowest: compat-%: setup
	rm -rf .venv-compat-$*
	$(PY) -m venv .venv-compat-$*
	$(UV_COMPILE) requirements/tools-compat.in $(COMPAT_EXTRAS) --resolution $(RESOLUTION_$*) --upgrade \
	    --no-header --no-annotate -o requirements/compat/$*.txt
	.venv-compat-$*/bin/pip install -q --no-deps -c constraints.txt torch==2.13.0+cpu
	.venv-compat-$*/bin/pip install -q --no-deps -r requirements/compat/$*.txt
	.venv-compat-$*/bin/pip install -q --no-deps --no-build-isolation -e .
	.venv-compat-$*/bin/pip check
	.venv-compat-$*/bin/python -m pytest -m "not slow" -p no:cacheprovider $(COMPAT_TESTS)

# The sdist and the wheel users install (the viewer's files and py.typed inside), built by the
# locked setuptools; tests/test_dist.py installs the wheel into a clean environment.
dist: setup
	rm -rf dist
	$(BIN)/python -m build --no-isolation --outdir dist .

demo: setup
	$(BIN)/multihead demo

bench: setup
	$(BIN)/python benchmarks/run_all.py

bench-quick: setup
	$(BIN)/python benchmarks/run_all.py --quick

clean:
	rm -rf $(VENV) .venv-compat-* build dist src/*.egg-info .pytest_cache
