#!/usr/bin/env bash
# The tma variant's measuring call (device machine, prebuilt package carried in prebuilt/:
# a jax_cluster built on the CPU machine in a Python 3.12 venv with jaxlib 0.11.2, so the
# call spends no time building): streaming-read bandwidth probe, GPU tests, the benchmark
# in parts, sanitizers. Step logs go to $OUT/<step>.log; the device tool returns at most 8
# files, so keep STEPS short (the tests log was lost to that limit twice).
#   STEPS="probe tests bench16a bench16b memcheck" bash benchmarks/swiglu_tma_call.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/${PREBUILT:-prebuilt}
STEPS=${STEPS:-probe tests bench16a bench16b memcheck}
t0=$SECONDS
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
BW=${BW:-}
sum=()
for s in $STEPS; do
  t=$SECONDS
  case $s in
    probe)
      nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -Icpp/include -o /tmp/gl benchmarks/micro/gemv_locality.cu && /tmp/gl >"$OUT/probe.txt" 2>&1
      BW=$(awk 'NR > 1 && $NF + 0 > m { m = $NF + 0 } END { printf "%.0f", m * 1e9 }' "$OUT/probe.txt"); echo "probe max $BW B/s" ;;
    tests)
      timeout ${TESTS_TIMEOUT:-80} python3 -P -m pytest -q -rfE --maxfail=3 -o faulthandler_timeout=40 -m gpu -p no:cacheprovider tests/test_swiglu.py -k "${TESTS_K:-(variants and tma) or chained or (deterministic and tma)}" >"$OUT/tests.log" 2>&1
      echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error|Timeout" "$OUT/tests.log" | tail -8 ;;
    bench*)
      case $s in
        bench16a) a="--dtypes float16 --ms 1,2,4,8" ;;  bench16b) a="--dtypes float16 --ms 16,32,64" ;;
        benchbfa) a="--dtypes bfloat16 --ms 1,2,4,8" ;; benchbfb) a="--dtypes bfloat16 --ms 16,32,64" ;;
        *) a="${BENCH_ARGS:-}" ;;
      esac
      timeout ${BENCH_TIMEOUT:-100} python3 benchmarks/swiglu.py --variants ${VARIANTS:-tma} $a ${BW:+--bandwidth $BW} --part "${s}" >"$OUT/$s.log" 2>&1
      echo "$s rc=$?"; grep -E "^  |missed|met" "$OUT/$s.log" | sed 's/goals missed:/missed:/' | cut -c1-220
      cp benchmarks/results/parts/swiglu_$s.json "$OUT"/ 2>/dev/null ;;
    memcheck|racecheck)
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${SAN_TIMEOUT:-60} compute-sanitizer --tool $s --kernel-name kns=swiglu --error-exitcode 9 python3 benchmarks/sanitize_targets.py --only=swiglu --quick --variants=tma >"$OUT/$s.log" 2>&1
      echo "$s rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|swiglu ok|Error" "$OUT/$s.log" | head -5 ;;
  esac
  sum+=("$s $((SECONDS - t)) s")
done
printf '%s\n' "${sum[@]}"; echo "total $((SECONDS - t0)) s"
