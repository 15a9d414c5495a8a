#!/usr/bin/env bash
# One device call for the swiglu tma work: build, focused GPU tests, focused benchmark.
#   TESTS_K="tma or chained" BENCH="--no-auto ..." bash benchmarks/swiglu_cycle.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export JAX_CLUSTER_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
python3 -m pip install --no-build-isolation --no-deps -v -C build-dir=${JC_BUILD_DIR:-/tmp/build-sw} . >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build $((SECONDS - t0)) s"
grep -A3 "swiglu_tma_kernel" "$OUT/build.log" | grep -E "Used|spill" | sort | uniq | head -8
if [ -n "${TESTS_K:-}" ]; then
  t1=$SECONDS
  timeout ${TESTS_TIMEOUT:-150} python3 -P -m pytest -q --maxfail=3 -m gpu -p no:cacheprovider tests/test_swiglu.py -k "$TESTS_K" >"$OUT/tests.log" 2>&1
  echo "tests rc=$? $((SECONDS - t1)) s"; grep -E "passed|failed|Error|error|assert" "$OUT/tests.log" | tail -12
fi
if [ -n "${EXTRA:-}" ]; then bash -c "$EXTRA"; fi
if [ -n "${BENCH:-}" ]; then
  t2=$SECONDS
  timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/swiglu.py $BENCH >"$OUT/bench.log" 2>&1
  echo "bench rc=$? $((SECONDS - t2)) s"; cat "$OUT/bench.log" | grep -v Warning | tail -50
  cp benchmarks/results/parts/swiglu_* benchmarks/results/swiglu.* "$OUT"/ 2>/dev/null
fi
echo "total $((SECONDS - t0)) s"
