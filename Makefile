# make test   - build the extension in place and run the whole test suite
# make bench  - build and benchmark the default workload (ddetr_enc, ddetr_dec on a
#               GPU; a scaled-down ddetr_enc on the CPU) for every backend and the reference
# Set FORCE_CUDA=1 to compile the CUDA kernels without a visible GPU; MAX_JOBS
# bounds the parallel compile jobs.
PYTHON ?= python3
BENCH_ARGS ?=

.PHONY: deps build test bench bench-full clean

deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch
	@$(PYTHON) -c "import pytest, setuptools" 2>/dev/null || $(PYTHON) -m pip install pytest setuptools
	@$(PYTHON) -c "import ninja" 2>/dev/null || $(PYTHON) -m pip install ninja || true

build: deps
	$(PYTHON) setup.py -q build_ext --inplace

test: build
	$(PYTHON) -m pytest -q tests

bench: build
	$(PYTHON) -m benchmarks.run $(BENCH_ARGS)

bench-full: build
	$(PYTHON) -m benchmarks.run --full $(BENCH_ARGS)

clean:
	rm -rf build ms_deform_attn/*.so *.egg-info
