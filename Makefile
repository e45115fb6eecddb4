# One-command set-up: every target creates the virtualenv it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: train test lint typecheck check clean benchmarks docs

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[app,dev,bench,test]"
	touch $(STAMP)

# The main job: dkfac's recommended default (KFACOptimizer.for_model), AdamW and Muon side by
# side on digits, each at its lr for the task (configs/digits.toml); report in runs/digits/.
train: $(STAMP)
	$(PY) -m dkfac compare --config configs/digits.toml --optimizers dkfac,adamw,muon \
		--out runs/digits --overwrite

# BENCHMARKS.md and its plots, rebuilt from the JSON in benchmarks/results/.
benchmarks: $(STAMP)
	$(PY) -m dkfac bench report

# Two worker processes: most tests run one thread's small tensor work, so a second core
# otherwise waits (2-core CI: about 560 s against 790 s serially).
test: $(STAMP)
	$(PY) -m pytest -q -n 2

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The API reference from the docstrings, offline, in build/docs/ (open build/docs/index.html).
# Any warning fails the build (a module that does not import, a docstring pdoc cannot
# render), except annotations pdoc cannot evaluate, which it shows as written.
DOCS_MODULES := dkfac dkfac.config dkfac.blocks dkfac.solvers dkfac.distributed dkfac.engine \
	dkfac.costmodel
docs: $(STAMP)
	$(PY) -W error -W "ignore:Error parsing type annotation" -m pdoc $(DOCS_MODULES) -o build/docs

check: test lint typecheck docs

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
