# make test   - install the test extras, build the extension in place, run the whole test suite
# make bench  - build and benchmark the default workload (ddetr_enc, ddetr_dec on a
#               GPU; a scaled-down ddetr_enc on the CPU) for every backend and the reference
# make cpp    - build and run the C++ example (examples/cpp) against the in-place build
# Set FORCE_CUDA=1 to compile the CUDA kernels without a visible GPU; MAX_JOBS
# bounds the parallel compile jobs. torch must be installed first (README).
PYTHON ?= python3
BENCH_ARGS ?=
# The extras the test suite uses (pyproject.toml): without them some tests skip.
TEST_EXTRAS ?= test hf onnx

.PHONY: deps build test bench bench-full cpp clean

deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "torch is not installed: pip install torch first (README, Install)"; exit 1; }
	@$(PYTHON) -c "import setuptools" 2>/dev/null || $(PYTHON) -m pip install setuptools
	@# The ninja module only where no ninja is on the PATH: two ninjas of
	@# different versions share build/ and the second rebuilds everything.
	@command -v ninja >/dev/null || $(PYTHON) -c "import ninja" 2>/dev/null || $(PYTHON) -m pip install ninja
	@$(PYTHON) -m pip install -q $$($(PYTHON) scripts/extras.py $(TEST_EXTRAS)) \
	  || echo "make: could not install the extras $(TEST_EXTRAS); the tests that need them will skip"

build: deps
	$(PYTHON) setup.py -q build_ext --inplace

test: build
	$(PYTHON) -m pytest -q tests

bench: build
	$(PYTHON) -m benchmarks.run $(BENCH_ARGS)

bench-full: build
	$(PYTHON) -m benchmarks.run --full $(BENCH_ARGS)

cpp: build
	@$(PYTHON) -c "import cmake" 2>/dev/null || command -v cmake >/dev/null || $(PYTHON) -m pip install -q $$($(PYTHON) scripts/extras.py cpp)
	cmake -S examples/cpp -B build-cpp -DCMAKE_PREFIX_PATH="$$($(PYTHON) -m ms_deform_attn --cmake-prefix-path)"
	cmake --build build-cpp -j
	./build-cpp/msda_example

clean:
	rm -rf build build-cpp ms_deform_attn/*.so ms_deform_attn/lib *.egg-info
