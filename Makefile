# One-command set-up: every target creates the virtualenv it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: train test lint typecheck check clean benchmarks

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[app,dev,bench,test]"
	touch $(STAMP)

# The main job: SGD and K-FAC side by side on digits; report in runs/digits/compare.md.
train: $(STAMP)
	$(PY) -m dkfac compare --config configs/digits.toml --optimizers sgd,kfac --out runs/digits

# BENCHMARKS.md and its plots, rebuilt from the JSON in benchmarks/results/.
benchmarks: $(STAMP)
	$(PY) -m dkfac bench report

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

check: test lint typecheck

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
