#!/usr/bin/env bash
# One device call for the swiglu tma work: build (or use a carried prebuilt package),
# focused GPU tests, extra commands, a focused benchmark; logs under $OUT, table last.
#   TESTS_K="tma or chained" BENCH="--no-auto ..." bash benchmarks/swiglu_cycle.sh
# PREBUILT=dir: a jax_cluster package built elsewhere for this machine's Python and jaxlib
# (e.g. a Python 3.12 venv with jaxlib 0.11.2 on the CPU machine), used via PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export JAX_CLUSTER_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
if [ -n "${PREBUILT:-}" ]; then
  export PYTHONPATH=$PWD/$PREBUILT${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import jax_cluster, jax; print('jax_cluster from', jax_cluster.__file__, 'jax', jax.__version__)"
else
  python3 -m pip install --no-build-isolation --no-deps -v -C build-dir=${JC_BUILD_DIR:-/tmp/build-sw} . >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build $((SECONDS - t0)) s"
fi
if [ -n "${TESTS_K:-}" ]; then
  t1=$SECONDS
  timeout ${TESTS_TIMEOUT:-150} python3 -P -m pytest -q -rA --maxfail=3 -o faulthandler_timeout=${FAULT_S:-60} -m gpu -p no:cacheprovider tests/test_swiglu.py -k "$TESTS_K" >"$OUT/tests.log" 2>&1
  echo "tests rc=$? $((SECONDS - t1)) s"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Timeout|assert" "$OUT/tests.log" | grep -v "^PASSED" | tail -12
fi
if [ -n "${EXTRA:-}" ]; then t3=$SECONDS; bash -c "$EXTRA"; echo "extra $((SECONDS - t3)) s"; fi
if [ -n "${BENCH:-}" ]; then
  t2=$SECONDS
  timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/swiglu.py $BENCH >"$OUT/bench.log" 2>&1
  echo "bench rc=$? $((SECONDS - t2)) s"; grep -v Warning "$OUT/bench.log" | tail -50
  if [ -n "${PART:-}" ]; then cp benchmarks/results/parts/swiglu_$PART.* "$OUT"/; fi
fi
echo "total $((SECONDS - t0)) s"
