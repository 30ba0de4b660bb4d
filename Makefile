# make test   - install the test extras, build the extension in place, run the whole test suite
# make bench  - build and benchmark the default workload (ddetr_enc, ddetr_dec on a
#               GPU; a scaled-down ddetr_enc on the CPU) for every backend and the reference
# make cpp    - build and run the C++ example (examples/cpp) against the in-place build
# make aoti   - export the small detector with AOTInductor and run it from C++ (examples/aoti)
# make kernels-build - the in-place build in the Hugging Face `kernels` layout (build/kernels)
# make wheel  - a wheel in dist/ for the installed torch, with the CUDA kernels for
#               WHEEL_ARCHS (A100 ... RTX 50: sm_80 sm_86 sm_89 sm_90a sm_100 sm_120, PTX
#               of the newest) where torch is a CUDA build and nvcc is found, the CPU
#               kernels otherwise; docs/development.md gives its build time and size.
#               CUDA=12 or CUDA=13: the wheel of that CUDA major, in dist/cu<major>/,
#               after checking that torch and nvcc are of it
# Set FORCE_CUDA=1 to compile the CUDA kernels without a visible GPU; MAX_JOBS
# bounds the parallel compile jobs. torch must be installed first (README).
PYTHON ?= python3
BENCH_ARGS ?=
# The extras the test suite uses (pyproject.toml): without them some tests skip.
TEST_EXTRAS ?= test hf onnx
WHEEL_ARCHS ?= 8.0;8.6;8.9;9.0a;10.0;12.0+PTX

.PHONY: deps build test bench bench-full cpp aoti wheel kernels-build clean

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

# The benchmarks need the bench extra (numpy, matplotlib for the chart, tqdm),
# not the test suite's.
bench bench-full: TEST_EXTRAS = bench

bench: build
	$(PYTHON) -m benchmarks.run $(BENCH_ARGS)

bench-full: build
	$(PYTHON) -m benchmarks.run --full $(BENCH_ARGS)

wheel:
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "torch is not installed: pip install torch first (README, Install)"; exit 1; }
	@command -v ninja >/dev/null || $(PYTHON) -c "import ninja" 2>/dev/null || $(PYTHON) -m pip install ninja
	@$(PYTHON) -c "import wheel" 2>/dev/null || $(PYTHON) -m pip install wheel
	@if [ -n "$(CUDA)" ]; then $(PYTHON) scripts/wheel_cuda.py "$(CUDA)"; fi
	@# The CUDA kernels where torch is a CUDA build and a CUDA toolkit is
	@# found (FORCE_CUDA=1 or 0 decides instead), else the CPU wheel.
	@force=$${FORCE_CUDA:-$$($(PYTHON) scripts/wheel_cuda.py --can-build)}; \
	  if [ "$$force" = 1 ]; then echo "make wheel: the CUDA kernels for $(WHEEL_ARCHS)"; \
	  else echo "make wheel: the CPU kernels only (no CUDA torch or no CUDA toolkit here; FORCE_CUDA=1 insists)"; fi; \
	  FORCE_CUDA=$$force TORCH_CUDA_ARCH_LIST="$(WHEEL_ARCHS)" \
	  $(PYTHON) -m pip wheel --no-build-isolation --no-deps -w dist$(if $(CUDA),/cu$(CUDA)) .

kernels-build: build
	$(PYTHON) scripts/kernels_build.py --out build/kernels

cpp: build
	@$(PYTHON) -c "import cmake" 2>/dev/null || command -v cmake >/dev/null || $(PYTHON) -m pip install -q $$($(PYTHON) scripts/extras.py cpp)
	cmake -S examples/cpp -B build-cpp -DCMAKE_PREFIX_PATH="$$($(PYTHON) -m ms_deform_attn --cmake-prefix-path)"
	cmake --build build-cpp -j
	./build-cpp/msda_example

aoti: build
	@$(PYTHON) -c "import cmake" 2>/dev/null || command -v cmake >/dev/null || $(PYTHON) -m pip install -q $$($(PYTHON) scripts/extras.py cpp)
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) examples/aoti/export_detector.py --device cpu --out build-aoti
	cmake -S examples/aoti -B build-aoti-cpp -DCMAKE_PREFIX_PATH="$$($(PYTHON) -m ms_deform_attn --cmake-prefix-path)"
	cmake --build build-aoti-cpp -j
	./build-aoti-cpp/aoti_detector build-aoti/model.pt2 build-aoti/io.pt

clean:
	rm -rf build build-cpp build-aoti build-aoti-cpp dist ms_deform_attn/*.so ms_deform_attn/lib ms_deform_attn/_build_info.py *.egg-info \
	  ms_deform_attn/include ms_deform_attn/share/ms_deform_attn
