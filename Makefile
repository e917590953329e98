# Two commands do all the set-up:  `make lab`  and  `make test`.
# Each creates the virtual environments it needs and re-installs only when pyproject.toml or a constraints file changed.
#   .venv        the newest releases the package index serves (constraints/newest.txt holds none): JupyterLab runs here
#   .venv-floor  the oldest torch pyproject.toml allows (constraints/floor.txt): `make test` runs the suite here too
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
FLOOR_VENV  ?= .venv-floor
FLOOR_PY    := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.installed

.PHONY: lab test test-newest test-floor test-fast lint bench bench-quick install clean-venv site site-gpu-import stress

# PIP_CONSTRAINT names our constraints file instead of any machine-wide one, which could hold torch back.
$(STAMP): pyproject.toml constraints/newest.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	PIP_CONSTRAINT=constraints/newest.txt $(PY) -m pip install --upgrade --quiet pip
	PIP_CONSTRAINT=constraints/newest.txt $(PY) -m pip install --quiet --upgrade --upgrade-strategy eager -e ".[test,dev]"
	touch $(STAMP)

$(FLOOR_STAMP): pyproject.toml constraints/floor.txt
	test -x $(FLOOR_PY) || $(PYTHON) -m venv $(FLOOR_VENV)
	PIP_CONSTRAINT=constraints/floor.txt $(FLOOR_PY) -m pip install --upgrade --quiet pip
	PIP_CONSTRAINT=constraints/floor.txt $(FLOOR_PY) -m pip install --quiet -e ".[test]"
	touch $(FLOOR_STAMP)

# The site's tools (pyproject's `site` extra: Sphinx, MyST-NB, Furo) on top, for `make site` and the browser test.
SITE_STAMP := $(VENV)/.installed-site
$(SITE_STAMP): $(STAMP)
	PIP_CONSTRAINT=constraints/newest.txt $(PY) -m pip install --quiet --upgrade --upgrade-strategy eager -e ".[site]"
	touch $(SITE_STAMP)

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

# ruff (lint and format) and mypy over the package, its tests and scripts: the first step of `make test`.
lint: $(STAMP) $(KERNEL)
	$(PY) -m ruff check helpers tests scripts conftest.py
	$(PY) -m ruff format --check helpers tests scripts conftest.py
	$(PY) -m mypy

# The whole suite (unit tests, every notebook, the browser test) on the newest torch, then unit tests and notebooks
# on the oldest torch pyproject.toml allows. Each half alone: `make test-newest`, `make test-floor`.
test: lint test-newest test-floor

# Each notebook runs once: nbval's run of it, every cell passed, is kept in build/executed/, and the browser test's
# site build renders those copies instead of executing the lessons again.
test-newest: $(STAMP) $(KERNEL) $(SITE_STAMP)
	@bash scripts/ensure-chromium.sh
	$(PY) -m pytest --keep-executed build/executed $(PYTEST_ARGS)

# The browser test drives JupyterLab, which runs in .venv; every other test runs here on the floor torch.
test-floor: $(FLOOR_STAMP)
	$(FLOOR_PY) -m pytest -m "not browser" $(PYTEST_ARGS)

# The quick check while editing (under a minute on 2 cores): no notebooks, processes, benchmark or browser.
test-fast: $(STAMP) $(KERNEL)
	$(PY) -m pytest -m "not slow and not browser" $(PYTEST_ARGS)

# torchrun restarting a group after one of its ranks is killed, STRESS_RUNS times in a row (10: about 3 minutes on
# 2 cores); each run must end bit-identical to a run never stopped. Not part of `make test`, which runs it once.
STRESS_RUNS ?= 10
stress: $(STAMP)
	@for run in $$(seq $(STRESS_RUNS)); do \
	  $(PY) -m pytest -q -p no:cacheprovider tests/test_torchrun.py -k "restarts_the_group and ddp" >/dev/null \
	    || { echo "run $$run of $(STRESS_RUNS) failed: rerun it with $(PY) -m pytest tests/test_torchrun.py -k 'restarts_the_group and ddp'"; exit 1; }; \
	  echo "run $$run of $(STRESS_RUNS): restarted once, bit-identical"; \
	done

# The lessons with their outputs, a static site that opens from disk: build/site/index.html. Executes each notebook
# whose executed copy in build/executed/ is stale (all nineteen the first time: 8-12 minutes on 2 cores), then renders.
site: $(SITE_STAMP) $(KERNEL)
	$(PY) scripts/build_site.py build

# A GPU run for the site: executed.tgz from ../shared/gpu/check.sh (its gpu.log beside it) into site/gpu/, to commit.
site-gpu-import: $(STAMP)
	@test -n "$(TGZ)" || { echo "usage: make site-gpu-import TGZ=path/to/executed.tgz"; exit 2; }
	$(PY) scripts/build_site.py import-gpu "$(TGZ)"

# The performance table: `make bench` (under 10 minutes on 2 cores), `make bench-quick` (under one and a half).
bench: $(STAMP)
	$(PY) -m helpers.cli.bench $(BENCH_ARGS)

bench-quick: $(STAMP)
	$(PY) -m helpers.cli.bench --quick $(BENCH_ARGS)

clean-venv:
	rm -rf $(VENV) $(FLOOR_VENV)
