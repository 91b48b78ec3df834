# Two-command set-up: `make demo` and `make test` create .venv and install the project
# when it is missing or pyproject.toml changed; the second time they skip straight on.

PYTHON ?= python3
VENV   ?= .venv
EXTRAS ?= dev,dft,slurm,tracking,vesin,mace
STAMP  := $(VENV)/.install-stamp
BIN    := $(VENV)/bin
DEMO_ARGS ?= --resume
PYTEST_ARGS ?=

.PHONY: demo test test-all test-slurm bench install lint clean-demo help

help:
	@echo "make demo      run the converged loop on small data (runs/demo, about 3 min on 2 cores, install included)"
	@echo "make test      run the default test suite (about 13 min on 2 cores, install included)"
	@echo "make test-all  also run tests marked slow"
	@echo "make test-slurm  the real-Slurm tests (starts a 2-node Slurm; root)"
	@echo "make lint      ruff over src/ and tests/"

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "error: Python >= 3.11 is needed (found " + sys.version.split()[0] + "); set PYTHON=python3.11")'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/convergent demo $(DEMO_ARGS)

clean-demo:
	rm -rf runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -m "slow or not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

bench: $(STAMP)
	@for f in bench/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

# The real-Slurm tests (tests/slurm): installs slurm-wlm + munge when missing (root, apt),
# then the session fixture starts munged, slurmctld and two slurmd and stops them after.
test-slurm: $(STAMP)
	bash scripts/system-deps.sh
	$(BIN)/python -m pytest tests/slurm $(PYTEST_ARGS)
