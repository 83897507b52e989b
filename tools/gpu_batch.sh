#!/usr/bin/env bash
# GPU host: the open issues' GPU checks from one carry of `make gpu-carry-kernels` (.gpu-carry1/part1), in two device
# calls of under 600 s each (the machine stays warm between them: the second finds .gpu/ assembled):
#   suite   the carry staged and assembled into .gpu/, then the GPU suite without the tests whose libraries that
#           carry leaves out (forced paths, models) in N processes (SUITE_S seconds each);
#   extras  the tensor-core prefill at head dims 96 / 256 (tests/gpu/test_prefill_tc_gpu.py on those shapes and
#           benchmarks/bench_prefill_dims_gpu.py: their libraries from tools/gpu_prefill_dims.py, built into .gpu/
#           before the carry) and the host cost of a decode step (bench_gpu.py on the bundle's 32/8/128 libraries).
# Logs and JSON under $OUT. Calls: run(carry=[".gpu-carry1/part1"], command="OUT=$OUT bash tools/gpu_batch.sh suite"),
# then run(command="OUT=$OUT bash tools/gpu_batch.sh extras").
set -u
OUT=${OUT:-/tmp}
case "${1:-}" in
  suite)
    python3 tools/carry.py stage .gpu-carry1/part1 /tmp/pagedkv-stage >/dev/null && \
      python3 tools/carry.py assemble /tmp/pagedkv-stage . || { echo "carry: stage / assemble failed"; exit 2; }
    OUT=$OUT N=${N:-4} SUITE_S=${SUITE_S:-420} \
      EXCLUDE=${EXCLUDE:-'test_cuda_paths_gpu|test_prefill_tc_gpu|test_smollm2_gpu|test_deepseek_v3_gpu|test_cuda_graph_gpu'} \
      bash tools/gpu_suite.sh ;;
  extras)
    test -f .gpu/bundle/activate.sh || { echo "no .gpu/: run the suite phase first (same warm machine)"; exit 2; }
    source .gpu/bundle/activate.sh
    export PYTHONPATH=$PWD/python:$PWD/benchmarks:$PYTHONPATH PAGEDKV_RUNTIME_LIB=$PWD/.gpu/lib/libpagedkv_runtime.so \
      PAGEDKV_KERNEL_DIR=$PWD/.gpu/kernels
    timeout 200 python3 -m pytest tests/gpu/test_prefill_tc_gpu.py -k "d96 or d256" -q -p no:cacheprovider -rs \
      >"$OUT/prefill_tc_dims.log" 2>&1
    echo "PREFILL_TC_RC=$?"; grep -E "^(FAILED|ERROR)" "$OUT/prefill_tc_dims.log" | head; tail -n 3 "$OUT/prefill_tc_dims.log"
    timeout 150 python3 benchmarks/bench_prefill_dims_gpu.py --out "$OUT/prefill_dims.json" >"$OUT/prefill_dims.log" 2>&1
    echo "PREFILL_DIMS_RC=$?"; tail -n 16 "$OUT/prefill_dims.log"
    timeout 180 python3 benchmarks/bench_gpu.py --bundle .gpu --only no-workload --dtypes float16 --out "$OUT" \
      >"$OUT/host_cost.log" 2>&1
    echo "HOST_COST_RC=$?"; tail -n 30 "$OUT/host_cost.log" ;;
  *) echo "usage: bash tools/gpu_batch.sh suite|extras" >&2; exit 2 ;;
esac
