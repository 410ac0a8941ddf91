# Two commands for a fresh machine: `make demo` and `make test`. Only python, pip and make are needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-all lint clean

# .venv is a file target: a second `make` does not reinstall.
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the local CPU build; a bare `torch` would pull a multi-GB CUDA build
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/moeadapt demo

# CI's suite: everything but the `slow` marks (longer variants of tests that also run here in a short form)
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q --timeout=900 --durations=25 -m "not slow" tests

# before a release: the slow variants too
test-all: $(VENV)/.installed
	$(BIN)/python -m pytest -q --timeout=900 tests

lint: $(VENV)/.installed
	$(BIN)/ruff check moeadapt tests benchmarks

clean:
	rm -rf $(VENV) runs
