# make test : install (into the active environment, or a fresh .venv) and run the test suite
# make test-fast : the suite without the tests marked slow (the inner loop; make test runs all)
# make lint : ruff (pyproject.toml's [tool.ruff]); make test runs it first
# make demo : install and run the main job (4-rank training comparison)
# make soak : install and run 20 seeded torchft fault schedules against a real lighthouse (< 3 min)
# make faults : install and run the torchft fault demo (4 replicas, one killed and restarted; < 3 min)
# make gpu-check [GPU_CHECK_OUT=DIR] : on a GPU machine, MPS + CUDA tests + every GPU benchmark (< 9 min)
# make gpu-steps [GPU_CHECK_OUT=DIR] : on a GPU machine, eager/graphed steps on both wires + GPT (< 9 min)
#
# Python: the active virtualenv if one is active, else .venv (created on first use).
# torch: an already-installed torch is kept; otherwise torch==2.13.0 is installed first, which on
# a machine without CUDA is the CPU build that lies on disk here (no multi-GB CUDA download).
SHELL := /bin/bash
ifdef VIRTUAL_ENV
PY ?= $(VIRTUAL_ENV)/bin/python
else
PY ?= .venv/bin/python
endif
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# test workers (pytest-xdist): one per core plus one, at most 4 (a worker often waits: on a
# launch, a timeout under test, a torchft quorum); gloo tests share a pool of ranks per worker
# (tests/distutil.py run_pooled). A fresh clone of ed5650e on the 2-core machine, 3 workers:
# make test 8 min 1 s, pytest 6 min 47 s, 1,921 passed, 36 skipped (2026-12-02; the same tests
# took 8 min 56 s and 10 min 17 s at fbf2861: the machine's speed varies by run; 12 min 30 s at
# 7bd1dca, 20 min 35 s at 2a42f95)
PYTEST_WORKERS ?= $(shell n=$$(( $$(nproc 2>/dev/null || echo 1) + 1 )); echo $$(( n < 4 ? n : 4 )))

# the build backend (setuptools >= 64) where it is installed already: pip then builds the
# editable install without fetching it into a throwaway environment first
NO_ISOLATION = $(shell $(PY) -c "import setuptools, sys; \
	sys.exit(int(setuptools.__version__.split('.')[0]) < 64)" 2>/dev/null && echo --no-build-isolation)

.PHONY: install test test-fast lint demo soak faults bench gpu-check gpu-steps clean

$(PY):
	python3 -m venv --system-site-packages .venv

install: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q $(NO_ISOLATION) -e ".[test,integrations,torchft]"
	@$(PY) -c "import torch, triton, oktopk_triton; print('oktopk-triton', oktopk_triton.__version__, '| torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.cuda.is_available())"

test: install lint
	$(PY) -m pytest -q -ra -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -ra -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow" $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check .

demo: install
	$(PY) -m oktopk_triton.cli demo

soak: install
	$(PY) -m oktopk_triton.bench.ft_soak --schedules 20

faults: install
	$(PY) -m oktopk_triton.cli faults

bench: install
	$(PY) -m oktopk_triton.cli kernels

gpu-check:
	python3 -m tools.gpu_check $(if $(GPU_CHECK_OUT),--out $(GPU_CHECK_OUT))

gpu-steps:
	python3 -m tools.gpu_check --plan steps $(if $(GPU_CHECK_OUT),--out $(GPU_CHECK_OUT))

clean:
	rm -rf .venv build *.egg-info .pytest_cache
