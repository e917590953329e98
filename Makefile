# Two commands do all the set-up:  `make lab`  and  `make test`.
# Both create .venv if it is missing and re-install only when pyproject.toml changed.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: lab test test-fast lint bench bench-quick install clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -e ".[test,dev]"
	touch $(STAMP)

# The environment as a named Jupyter kernel, "torch-course (.venv)", which the notebooks ask for by name.
# It is registered inside .venv (--sys-prefix), so it always points at this environment's Python.
KERNEL := $(VENV)/share/jupyter/kernels/torch-course/kernel.json
$(KERNEL): $(STAMP)
	$(PY) -m ipykernel install --sys-prefix --name torch-course --display-name "torch-course (.venv)" >/dev/null
	@echo "registered the Jupyter kernel 'torch-course (.venv)' ($(PY))"

install: $(STAMP) $(KERNEL)

# JupyterLab refuses to start as root (containers, cloud VMs) unless told it is deliberate.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: $(STAMP) $(KERNEL)
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(LAB_ARGS)

# ruff (lint and format) and mypy over the package and its tests: the first step of `make test`.
lint: $(STAMP) $(KERNEL)
	$(PY) -m ruff check helpers tests conftest.py
	$(PY) -m ruff format --check helpers tests conftest.py
	$(PY) -m mypy

test: lint
	@bash scripts/ensure-chromium.sh
	$(PY) -m pytest $(PYTEST_ARGS)

# The quick check while editing (under a minute on 2 cores): no notebooks, processes, benchmark or browser.
test-fast: $(STAMP) $(KERNEL)
	$(PY) -m pytest -m "not slow and not browser" $(PYTEST_ARGS)

# The performance table: `make bench` (under 10 minutes on 2 cores), `make bench-quick` (under one).
bench: $(STAMP)
	$(PY) -m helpers.cli.bench $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(PY) -m helpers.cli.bench --quick $(BENCH_ARGS)

clean-venv:
	rm -rf $(VENV)
