# Two-command set-up: `make demo` and `make test` create .venv and install the project
# when it is missing or pyproject.toml changed; the second time they skip straight on.

PYTHON ?= python3
VENV   ?= .venv
EXTRAS ?= dev,dft,slurm,tracking,vesin,mace,schnetpack,eval
STAMP  := $(VENV)/.install-stamp
BIN    := $(VENV)/bin
DEMO_ARGS ?= --resume
PYTEST_ARGS ?=

.PHONY: demo test test-all test-slurm test-gpu test-portability bench install install-bench lint clean-demo help

help:
	@echo "make demo      run the converged loop on small data (runs/demo, about 3 min on 2 cores, install included)"
	@echo "make test      run the default test suite over pytest-xdist workers (TEST_JOBS; install included)"
	@echo "make test-all  also run tests marked slow"
	@echo "make test-portability  the tests marked numerics under each CPU kernel setting (ATen/oneDNN ISA caps; about 2.5 min on 2 cores)"
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

# The default suite over TEST_JOBS pytest-xdist workers (up to 4; none on one core): many
# tests wait on subprocesses (torchrun, Dask, Slurm), so two workers on two cores nearly
# halve the wall time. One file's tests run on one worker (its module fixtures are built
# once); each worker's Slurm fixture has its own ports (tests/slurm/conftest.py). TEST_JOBS=0:
# one process. (--dist loadgroup would group folders, but with pytest-xdist 3.8 on this
# pytest its xdist_group marks did not keep a group on one worker.)
# The slowest tests are listed at the end of every run (the suite must stay under 15
# minutes on 2 cores; CI's log says where the time goes).
TEST_DURATIONS ?= --durations=30
TEST_JOBS ?= $(shell n=$$(nproc); [ $$n -ge 2 ] && echo $$(( n < 4 ? n : 4 )) || echo 0)

test: $(STAMP)
	@xd=""; [ "$(TEST_JOBS)" -gt 0 ] && xd="-n $(TEST_JOBS) --dist loadfile"; \
	  echo "$(BIN)/python -m pytest $$xd $(TEST_DURATIONS) $(PYTEST_ARGS)"; $(BIN)/python -m pytest $$xd $(TEST_DURATIONS) $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -m "slow or not slow" $(PYTEST_ARGS)

# The benchmarks' peers (Lightning Fabric, Accelerate, schnetpack, webdataset): extra 'bench'.
install-bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS),bench]'

# The whole default suite (not only the `gpu` tests) on a CUDA machine, with pytest-xdist over
# three quarters of its cores when it has 8 or more (2 threads per test process unless
# OMP_NUM_THREADS says otherwise), log in GPU_LOG. GPU machines come with their own torch:
# GPU_PYTHON is that interpreter, and the tree's src/ goes on PYTHONPATH as an absolute path
# (tests run the CLI from other working directories). Where the image has no `convergent`
# console script, a shim per interpreter goes in .gpu-bin/ and on PATH.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_JOBS   ?= $(shell n=$$(nproc); [ $$n -ge 8 ] && echo $$((n * 3 / 4)) || echo 0)
GPU_LOG    ?= bench/results/gpu_suite.log
GPU_CHECK  ?= 1
# -v: each test's name as it ends, so a run stopped at its time limit still names its failures
GPU_PYTEST_FLAGS ?= -v -rfE --durations=25
test-gpu:
	@[ "$(GPU_CHECK)" = 0 ] || $(GPU_PYTHON) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "make test-gpu: no CUDA device here (torch.cuda.is_available() is False); run make test")'
	@jobs=$(GPU_JOBS); if [ "$$jobs" -gt 0 ] && ! $(GPU_PYTHON) -c 'import xdist' 2>/dev/null; then \
	  echo "make test-gpu: pytest-xdist is not installed; running on one process" >&2; jobs=0; fi; \
	  xd=""; [ "$$jobs" -gt 0 ] && xd="-n $$jobs --dist loadfile"; \
	  if ! command -v convergent >/dev/null && [ ! -x "$$(dirname $(GPU_PYTHON))/convergent" ]; then \
	    py=$$(command -v $(GPU_PYTHON)); bin=$$PWD/.gpu-bin/$$(printf %s "$$py" | cksum | cut -d' ' -f1); \
	    mkdir -p $$bin; printf '#!/bin/sh\nexec %s -c "import sys; from convergent.cli import entry; sys.exit(entry())" "$$@"\n' \
	      "$$py" > $$bin/convergent.tmp; chmod +x $$bin/convergent.tmp; mv -f $$bin/convergent.tmp $$bin/convergent; \
	    export PATH="$$bin:$$PATH"; fi; \
	  export OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2}; \
	  PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} bash -o pipefail -c \
	  "$(GPU_PYTHON) -m pytest -m 'not slow or gpu' $$xd -p no:cacheprovider $(GPU_PYTEST_FLAGS) $(PYTEST_ARGS) 2>&1 | tee $(GPU_LOG)"

# The tests marked `numerics` (results compared under a tolerance that depends on the CPU's
# kernels) once per kernel setting another CPU would get: ATen's dispatch level
# (ATEN_CPU_CAPABILITY) and oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA); the AVX-512 pass only
# where /proc/cpuinfo has avx512f. Variables already set in the caller's environment are
# dropped first, so "unrestricted" is; tests/test_portability.py checks that the names
# take effect. Every setting runs; the target fails after, naming those that failed.
PORTABILITY_SETTINGS = "" "ATEN_CPU_CAPABILITY=default" "ATEN_CPU_CAPABILITY=avx2" \
	"ONEDNN_MAX_CPU_ISA=AVX2" "ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX512_CORE"

test-portability: $(STAMP)
	@failed=""; for setting in $(PORTABILITY_SETTINGS); do \
	  case "$$setting" in *avx512*|*AVX512*) \
	    if ! grep -qw avx512f /proc/cpuinfo; then \
	      echo "== $$setting: skipped (this CPU has no avx512f)"; continue; fi;; esac; \
	  run="env -u ATEN_CPU_CAPABILITY -u ONEDNN_MAX_CPU_ISA $$setting"; \
	  echo "== $${setting:-unrestricted}: $$($$run $(BIN)/python -c 'import torch; print("ATen", torch.backends.cpu.get_cpu_capability(), "oneDNN bf16", torch.ops.mkldnn._is_mkldnn_bf16_supported())' 2>/dev/null)"; \
	  $$run $(BIN)/python -m pytest -m "numerics and not slow" -q -p no:cacheprovider $(PYTEST_ARGS) \
	    || failed="$$failed [$${setting:-unrestricted}]"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-portability failed under:$$failed"; exit 1; fi

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

# Every benchmark, one after another, as modules from the checkout's root (each writes its
# JSON to bench/results/), then the results table of docs/benchmarks.md. collectives needs
# root, gpu.throughput a CUDA GPU (it exits 2 without one).
BENCHES = bench.learn.active_learning bench.learn.active_learning_ceiling \
	bench.analytics.commands bench.train.collectives bench.train.compression \
	bench.compress.inference bench.dataio.read bench.gpu.throughput bench.models.md_stability \
	bench.models.accuracy bench.models.cost bench.models.scaling bench.models.neighbors \
	bench.train.pipeline_molecular bench.serve.dispatch bench.serve.throughput \
	bench.sim.throughput bench.train.throughput bench.models.transfer bench.tables

bench: $(STAMP)
	@for m in $(BENCHES); do echo "== python -m $$m"; $(BIN)/python -m $$m || exit 1; done

# The real-Slurm tests (tests/slurm): installs slurm-wlm + munge when missing (root, apt),
# then the session fixture starts munged, slurmctld and two slurmd and stops them after.
test-slurm: $(STAMP)
	bash scripts/system-deps.sh
	$(BIN)/python -m pytest tests/slurm $(PYTEST_ARGS)
