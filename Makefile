# Everything runs from the checkout's own virtualenv; docs/setup.md explains each step.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# `make test`: the fast default (each method, form, architecture family and CLI verb at least once; one
# Triton-interpreter case per kernel code path); `make test-all`: every test, the slow ones and all
# interpreter cases too (the gpu ones skip without CUDA). Both list their 15 slowest tests. An `-m` in
# PYTEST_ARGS comes last and so replaces FAST.
FAST := not slow and not interpreter and not gpu
# The Hugging Face hub is out of reach here: fail at once instead of retrying for a minute.
export HF_HUB_OFFLINE ?= 1

# Stamps make a finished step a no-op until its inputs change.
INSTALLED := $(VENV)/.installed
ASSETS := $(VENV)/.assets-fetched

.PHONY: setup test test-all demo lint

setup: $(ASSETS)

$(INSTALLED): pyproject.toml requirements/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --no-input -c requirements/cpu.txt pip setuptools
	$(PY) -m pip install --no-input -r requirements/cpu.txt
	$(PY) -m pip install --no-input --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	touch $@

$(ASSETS): $(INSTALLED) $(wildcard linearize/assets/*.py)
	$(PY) -m linearize.assets fetch
	touch $@

test: setup
	$(PY) -m pytest -q --durations=15 -m "$(FAST)" $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/linearize demo

lint: $(INSTALLED)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports --no-cache
