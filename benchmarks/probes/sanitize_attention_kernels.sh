#!/bin/bash
# memcheck and racecheck of every attention_decode kernel, run alone through the probe
# benchmarks/probes/attention_kernel.cu (one decode step per configuration), not inside a
# JAX process: there compute-sanitizer 2025.3.1's racecheck stops with "Internal Sanitizer
# Error: failed to handle a hardware exception" at the first kernel (session 16); alone
# the same kernels run to the end (session 17).
#   [ONLY=SUBSTRING] bash benchmarks/probes/sanitize_attention_kernels.sh [PROBE_BINARY] > sanitize.log
# Without a binary it builds one (2-3 min: build it on the CPU machine and carry it). The
# build makes every lane of the TMA kernel's consumer warps arrive on the ring's "empty"
# barrier (JC_RING_ARRIVE_PER_LANE in jax_cluster/tma.cuh): racecheck does not follow the
# __syncwarp before the single arrive of the real kernel and flags every stage reuse.
# Prints one line per (tool, configuration) and exits non-zero if any found something.
set -u
cd "$(dirname "$0")/../.."
bin=${1:-}
if [ -z "$bin" ]; then
  bin=/tmp/attention_kernel_sanitize
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo \
    -DAK_WITH_TILED -DJC_RING_ARRIVE_PER_LANE -Icpp -Icpp/include benchmarks/probes/attention_kernel.cu \
    cpp/kernels/attention_decode_tiled_f16.cu -o "$bin" || exit 1
fi

# D Hq Hkv Dh ctx batch cluster heads_per_cluster [variant]: every kernel (registers,
# tma, split_head, batch-tiled), head_dim 64/80/96/128, MHA/GQA/MQA, cluster sizes
# 1/2/3/4/5/8/16, batch 1-8 with ragged lengths (row 0 at the first token).
configs=(
  "4096 32 8 128 1024 1 8 2"
  "4096 32 32 128 1024 1 3 1"
  "1024 16 4 64 300 3 4 2"
  "1280 16 16 80 77 2 5 1"
  "1536 16 2 96 129 3 2 8"
  "1024 8 8 128 33 1 16 1"
  "512 8 1 64 17 3 1 8"
  "4096 32 8 128 1024 1 8 2 tma"
  "1024 16 4 64 300 3 4 2 tma"
  "1280 16 16 80 77 2 2 1 tma"
  "1024 16 4 64 300 3 4 2 split_head"
  "2048 16 16 128 200 2 4 1 split_head"
  "1024 16 4 64 300 4 4 2 rows=2"
  "4096 32 8 128 512 8 4 2 rows=4"
  "1280 16 16 80 77 3 2 1 rows=2"
)
failed=0
export AK_STEPS=1 AK_RAGGED=1
for cfg in "${configs[@]}"; do
  [[ -n "${ONLY:-}" && "$cfg" != *"$ONLY"* ]] && continue  # ONLY=tma: those configurations
  for tool in memcheck racecheck; do
    extra=()
    [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
    out=$(timeout 300 compute-sanitizer --tool "$tool" "${extra[@]}" "$bin" $cfg 2>&1)
    rc=$?
    summary=$(echo "$out" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY" | tail -n 1)
    if [ $rc -ne 0 ] || ! echo "$summary" | grep -qE "SUMMARY: (0 errors|0 hazards displayed \(0 errors, 0 warnings\))$"; then
      failed=1
      echo "FAIL $tool [$cfg] rc=$rc"
      echo "$out" | tail -n 30
    else
      echo "ok   $tool [$cfg] ${summary#========= }"
    fi
  done
done
exit $failed
