# Two-command set-up: `make demo` and `make test` create .venv and install the project
# when it is missing or pyproject.toml changed; the second time they skip straight on.

PYTHON ?= python3
VENV   ?= .venv
EXTRAS ?= dev,dft,slurm,tracking,vesin,mace
STAMP  := $(VENV)/.install-stamp
BIN    := $(VENV)/bin
DEMO_ARGS ?= --resume
PYTEST_ARGS ?=

.PHONY: demo test test-all test-slurm test-gpu bench install install-bench lint clean-demo help

help:
	@echo "make demo      run the converged loop on small data (runs/demo, about 3 min on 2 cores, install included)"
	@echo "make test      run the default test suite (about 13 min on 2 cores, install included)"
	@echo "make test-all  also run tests marked slow"
	@echo "make test-slurm  the real-Slurm tests (starts a 2-node Slurm; root)"
	@echo "make lint      ruff over src/ and tests/"
	@echo "make test-gpu  the whole default suite with CUDA visible, over the machine's cores (GPU machine)"
	@echo "make install-bench  also install the peers the benchmarks compare against (extra 'bench')"

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

# The benchmarks' peers (Lightning Fabric, Accelerate, schnetpack, webdataset): extra 'bench'.
install-bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS),bench]'

# The whole default suite (not only the `gpu` tests) on a CUDA machine, with pytest-xdist over
# half its cores when it has 8 or more, log in GPU_LOG. GPU machines come with their own
# torch: GPU_PYTHON is that interpreter, and the tree's src/ goes on PYTHONPATH.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_JOBS   ?= $(shell n=$$(nproc); [ $$n -ge 8 ] && echo $$((n / 2)) || echo 0)
GPU_LOG    ?= bench/results/gpu_suite.log
GPU_CHECK  ?= 1
test-gpu:
	@[ "$(GPU_CHECK)" = 0 ] || $(GPU_PYTHON) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "make test-gpu: no CUDA device here (torch.cuda.is_available() is False); run make test")'
	@jobs=$(GPU_JOBS); if [ "$$jobs" -gt 0 ] && ! $(GPU_PYTHON) -c 'import xdist' 2>/dev/null; then \
	  echo "make test-gpu: pytest-xdist is not installed; running on one process" >&2; jobs=0; fi; \
	  xd=""; [ "$$jobs" -gt 0 ] && xd="-n $$jobs --dist loadfile"; \
	  PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} bash -o pipefail -c \
	  "$(GPU_PYTHON) -m pytest -m 'not slow or gpu' $$xd -p no:cacheprovider $(PYTEST_ARGS) 2>&1 | tee $(GPU_LOG)"

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

bench: $(STAMP)
	@for f in bench/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

# The real-Slurm tests (tests/slurm): installs slurm-wlm + munge when missing (root, apt),
# then the session fixture starts munged, slurmctld and two slurmd and stops them after.
test-slurm: $(STAMP)
	bash scripts/system-deps.sh
	$(BIN)/python -m pytest tests/slurm $(PYTEST_ARGS)
