#!/usr/bin/env bash
# GPU host, after `make gpu-assemble` (or `tools/carry.py assemble`): the GPU suite from .gpu/ in N pytest
# processes side by side (one GPU; the suite is mostly host-bound, so three processes take about a third of the
# wall time), the test files dealt largest first, round robin. Logs: $OUT/suite<i>.log; the last lines of each
# are printed. N (3) and SUITE_S (each process' limit, 420 s) from the environment; EXCLUDE, a regex of test files
# to leave out (e.g. the forced-path tests after `gpu_bundle --no-path-libraries`); extra pytest arguments pass.
set -u
N=${N:-3}
LIMIT=${SUITE_S:-420}
LOGS=${OUT:-/tmp}
source .gpu/bundle/activate.sh
if [ -f .gpu/extra-env.sh ]; then source .gpu/extra-env.sh; fi
export PYTHONPATH=$PWD/python:$PWD/benchmarks:${PYTHONPATH:-} \
  PAGEDKV_RUNTIME_LIB=$PWD/.gpu/lib/libpagedkv_runtime.so \
  PAGEDKV_KERNEL_DIR=$PWD/.gpu/kernels PAGEDKV_MODEL_DIR=$PWD/.gpu/models
mapfile -t files < <(ls -S tests/gpu/test_*.py | grep -Ev "${EXCLUDE:-^$}")
pids=()
for ((i = 0; i < N; i++)); do
  sel=()
  for ((j = i; j < ${#files[@]}; j += N)); do sel+=("${files[j]}"); done
  timeout "$LIMIT" python3 -m pytest "${sel[@]}" -q -p no:cacheprovider -rs "$@" >"$LOGS/suite$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for ((i = 0; i < N; i++)); do
  wait "${pids[i]}" || rc=$?
  echo "== suite$i (${#files[@]} files in $N processes)"; grep -E "^(FAILED|ERROR)" "$LOGS/suite$i.log" | head -20
  tail -n 3 "$LOGS/suite$i.log"
done
exit $rc
