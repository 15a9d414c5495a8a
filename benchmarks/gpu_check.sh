#!/usr/bin/env bash
# One call on the GPU machine: build there (or install a carried wheel), run the GPU tests,
# the sanitizers and the named benchmarks; logs packed into $OUT/logs.tgz (default
# ./gpu_out), a short table last and in $OUT/summary.txt.
#   bash benchmarks/gpu_check.sh [--tests PATHS] [-k EXPR] [--shard K/N] [--no-sanitize] [bench ...]
#   (bench: a script under benchmarks/ without .py, e.g. swiglu or probes/swiglu_mixed;
#   BENCH_ARGS: arguments for every bench, e.g. BENCH_ARGS=--quick)
#   e.g. bash benchmarks/gpu_check.sh --tests tests/test_attention_block.py attention_block
#   (the whole GPU suite takes about 20 minutes in 8 processes on an H200: --shard 0/3, 1/3 and
#   2/3 split it into three calls that each fit a 10-minute limit)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
TESTS="tests"
SANITIZE=1
SELECT=()
SHARD=()
BENCHES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) TESTS="$2"; shift 2 ;;
    -k) SELECT=(-k "$2"); shift 2 ;;
    --shard) SHARD=(--shard "$2"); shift 2 ;;
    --no-sanitize) SANITIZE=0; shift ;;
    *) BENCHES+=("$1"); shift ;;
  esac
done
summary=()
step() {  # step NAME LOGFILE CMD...
  local name="$1" log="$2"; shift 2
  local t0=$SECONDS
  "$@" >"$OUT/$log" 2>&1
  local rc=$?
  summary+=("$(printf '%-34s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$log")")
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/device.txt" 2>&1
export JAX_CLUSTER_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
# JC_BUILD_DIR: a build folder outside the tree (a copy carried to the machine is replaced
# on every call; a folder elsewhere keeps the build incremental while the machine is warm).
build_args=()
if [ -n "${JC_BUILD_DIR:-}" ]; then build_args=(-C "build-dir=$JC_BUILD_DIR"); fi
# JC_WHEEL: a wheel built on the CPU machine for the device's Python and jaxlib (saves the
# 3-minute build of a fresh machine), e.g. with a Python 3.12 venv holding jax 0.11.2:
#   JAX_CLUSTER_CUDA=ON pip wheel --no-build-isolation --no-deps -w .carry/wheel .
# and run(carry=[".carry/wheel"]) with JC_WHEEL=$(ls .carry/wheel/*.whl).
# JC_SAVE_WHEEL=1: build a wheel, install it, and return it in 15 MB pieces ($OUT/wheel.part.*;
# the device tool returns files of at most 16 MiB): joined here with
#   cat .../wheel.part.* > .carry/wheel/jax_cluster-0.1.0-cp312-cp312-linux_x86_64.whl
# it is carried to the next fresh machine as JC_WHEEL. A carried wheel's compiled modules are
# kept, its Python files replaced by the tree's (Python changes need no rebuild).
site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ -n "${JC_WHEEL:-}" ]; then
  step install-wheel build.log bash -c "python3 -m pip install --no-deps --force-reinstall '$JC_WHEEL' &&
    cp -r jax_cluster flax_models '$site'/"
elif [ -n "${JC_SAVE_WHEEL:-}" ]; then
  step build build.log bash -c "python3 -m pip wheel --no-build-isolation --no-deps -v -w /tmp/jc_wheel . &&
    python3 -m pip install --no-deps --force-reinstall /tmp/jc_wheel/jax_cluster-*.whl &&
    split -b 15000000 /tmp/jc_wheel/jax_cluster-*.whl '$OUT'/wheel.part."
else
  step build build.log python3 -m pip install --no-build-isolation --no-deps -v "${build_args[@]}" .
fi || { tail -40 "$OUT/build.log"; printf '%s\n' "${summary[@]}"; exit 1; }
# pytest-xdist, when a wheel of it is carried in .carry/wheels (the machine has no network):
# the GPU tests in 8 processes.
XDIST=()
if ls .carry/wheels/pytest_xdist-*.whl >/dev/null 2>&1 &&
   python3 -m pip install -q --no-index --find-links .carry/wheels pytest-xdist >"$OUT/xdist_install.log" 2>&1; then
  XDIST=(-n 8)
  # eight processes share one GPU: each allocates on demand instead of taking 75% of it
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
fi
# -P: the source tree (no compiled modules) must not shadow the installed package
step gpu-tests gpu_tests.log python3 -P -m pytest -q -m gpu -p no:cacheprovider "${XDIST[@]}" "${SELECT[@]}" "${SHARD[@]}" $TESTS
tail -5 "$OUT/gpu_tests.log"
for b in "${BENCHES[@]}"; do
  step "bench-$b" "bench_${b//\//_}.log" python3 "benchmarks/$b.py" ${BENCH_ARGS:-}
  cp benchmarks/results/"$b".* "$OUT"/ 2>/dev/null
done
if [ "$SANITIZE" = 1 ]; then
  # XLA's preallocation of most of the GPU crashed under memcheck: allocate on demand.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  # compute-sanitizer segfaulted (H100, both tools, also with --kernel-name-exclude) whenever
  # attention_block's small combine kernel was among the kernels it instruments, so
  # attention_block's main kernels are checked by name, each alone.
  # Only our kernels are instrumented (kns: kernel-name substring): instrumenting XLA's made
  # racecheck time out.
  sanitize() {  # sanitize TOOL FILTER TARGETS [ARGS...]
    local tool=$1 filter=$2 only=$3; shift 3
    local tag="${tool}_${filter}_${only//,/+}"
    # racecheck does not follow programmatic launches (H100: it segfaulted at the first
    # attention kernel launched with PDL, and ran with plain launches): plain launches.
    # (SANITIZE_PDL=0 sanitize ...: plain launches for a target whose process the tool
    # crashes with them)
    local pdl=${SANITIZE_PDL:-1}; [ "$tool" = racecheck ] && pdl=0
    JAX_CLUSTER_PDL=$pdl step "sanitize-$tag" "sanitize_$tag.log" timeout 150 compute-sanitizer \
      --tool "$tool" --kernel-name "kns=$filter" --error-exitcode 9 \
      python3 benchmarks/sanitize_targets.py --only="$only" "$@"
  }
  sanitize memcheck jax_cluster collectives,swiglu
  sanitize memcheck swiglu_tma linear
  sanitize memcheck moe_ moe_decode
  sanitize racecheck moe_ moe_decode --quick
  sanitize memcheck moe_route moe_route
  sanitize racecheck moe_route moe_route --quick
  # (decoder_layer's racecheck inside JAX: the tool segfaults at its attention phase, as for
  # decode_attention; the probes below check it.)
  sanitize memcheck decoder_layer decoder_layer
  # mla_decode's whole step through JAX (its kernels' racecheck: the probes below). With
  # programmatic launches memcheck segfaults inside this process (H200) on the 4-split paged
  # case, with the kernels' own probes clean: plain launches (clean).
  SANITIZE_PDL=0 sanitize memcheck mla_ mla_decode
  # (decode_attention's kernels: compute-sanitizer itself segfaults at their first launch in a
  # JAX process, with and without programmatic launches, on H200; they are checked outside
  # JAX by the probes below.)
  sanitize memcheck flash_attention_kernel flash_attention --quick --flash-kernel=mma
  sanitize memcheck attention_block_kernel attention_block --pipelines=registers --dataflows=split_token
  sanitize memcheck attention_block_tma_kernel attention_block --pipelines=tma
  sanitize memcheck attention_block_split_head attention_block --dataflows=split_head
  # the wgmma flash_attention kernel by name (clean alone; memcheck over every jax_cluster
  # kernel in one process crashed the tool)
  sanitize memcheck flash_attention_sm90 flash_attention --quick --flash-kernel=wgmma
  sanitize racecheck flash_attention_sm90 flash_attention --quick --flash-kernel=wgmma
  sanitize racecheck jax_cluster collectives --quick
  sanitize racecheck flash_attention_kernel flash_attention --quick --flash-kernel=mma
  sanitize racecheck swiglu_tma linear --quick
  # racecheck (compute-sanitizer 2025.3.1, H100) stops with "Internal Sanitizer Error: failed
  # to handle a hardware exception" on swiglu's whole configuration list in one process, yet
  # each variant alone is clean: one process per variant.
  for v in gemv fused tma; do
    JAX_CLUSTER_PDL=0 step "sanitize-racecheck-swiglu-$v" "sanitize_racecheck_swiglu_$v.log" timeout 150 \
      compute-sanitizer --tool racecheck --kernel-name kns=swiglu --error-exitcode 9 \
      python3 benchmarks/sanitize_targets.py --only=swiglu --quick --variants=$v
  done
  # Inside a JAX process racecheck stops with the same internal error at the first
  # attention_block or decode_attention kernel; alone, outside JAX, the same kernels run to
  # the end. So their racecheck (and a memcheck) runs through the standalone probes.
  # JC_ATTENTION_PROBE, JC_DECODE_ATTENTION_PROBE: the probes built on the CPU machine (see
  # the script), else they are built here (2-3 min).
  step sanitize-attention-probes sanitize_attention_probes.log \
    bash benchmarks/probes/sanitize_attention_kernels.sh
  grep -h "ERROR SUMMARY\|RACECHECK SUMMARY\| ok$\|^ok \|^FAIL" "$OUT"/sanitize_*.log
fi
{
  echo "== summary ($(head -2 "$OUT/device.txt" | tail -1))"
  printf '%s\n' "${summary[@]}"
  for b in "${BENCHES[@]}"; do cat "benchmarks/results/$b.md" 2>/dev/null | tail -n +7; done
} | tee "$OUT/summary.txt"
# The device tool returns at most 8 files from $OUT: everything else goes into one archive.
tar -czf /tmp/gpu_check_logs.tgz -C "$OUT" --exclude=summary.txt --exclude='wheel.part.*' . &&
  find "$OUT" -mindepth 1 ! -name summary.txt ! -name 'wheel.part.*' -delete && mv /tmp/gpu_check_logs.tgz "$OUT/logs.tgz"
