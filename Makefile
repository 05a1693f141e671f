# Two entry points (README): `make demo` builds the demo bundle if missing and serves it;
# `make test` installs everything the tests need and runs them.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test install lint bench-latency clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned to the CPU build that installs locally (a looser pin pulls gigabytes of CUDA).
install: $(BIN)/python
	$(BIN)/pip install -q -e '.[train,dev]'

demo: install
	$(BIN)/shortlist demo --workdir .demo

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

bench-latency: install
	$(BIN)/python bench/latency.py

clean:
	rm -rf .demo .pytest_cache
