#!/bin/bash
# Probe: memcheck and racecheck of every attention_block, decode_attention, mla_decode,
# decoder_layer and moe_decode expert kernel, run alone through the standalone probes (benchmarks/probes/
# attention_kernel.cu: one decode step per configuration; decode_attention_kernel.cu: plain
# and append mode; mla_decode_kernel.cu: contiguous and paged latent caches;
# mla_projections_kernel.cu: mla_decode's projection kernels;
# decoder_layer_kernel.cu: the one-launch layer; moe_decode_kernel.cu: the expert GEMVs and
# the combine; moe_route_kernel.cu: the router), not inside a JAX
# process: there compute-sanitizer 2025.3.1's racecheck stops with "Internal Sanitizer
# Error: failed to handle a hardware exception" at the first kernel; alone the same kernels
# run to the end (docs/attention_block.md).
#   [ONLY=SUBSTRING] bash benchmarks/probes/sanitize_attention_kernels.sh > sanitize.log
# JC_ATTENTION_PROBE, JC_DECODE_ATTENTION_PROBE, JC_MLA_PROBE, JC_MLA_PROJ_PROBE, JC_LAYER_PROBE,
# JC_MOE_PROBE, JC_ROUTE_PROBE: the probe
# binaries; without them they are
# built here (2-3 min: build them on the CPU machine with the commands below and carry
# them). The attention_block probe is built with every lane of the TMA kernel's consumer
# warps arriving on the ring's "empty" barrier (JC_RING_ARRIVE_PER_LANE in
# jax_cluster/tma.cuh): racecheck does not follow the __syncwarp before the single arrive
# of the real kernel and flags every stage reuse.
# Prints one line per (tool, configuration) and exits non-zero if any found something.
set -u
cd "$(dirname "$0")/../.."
nvcc_flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo
            -Icpp -Icpp/include)
wanted() { [[ -z "${ONLY:-}" || "$1" == *"$ONLY"* || "$ONLY" == *"$1"* ]]; }  # a probe ONLY can reach
ak=${JC_ATTENTION_PROBE:-}
if [ -z "$ak" ] && wanted attention_block; then
  ak=/tmp/attention_kernel_sanitize
  nvcc "${nvcc_flags[@]}" -DJC_RING_ARRIVE_PER_LANE benchmarks/probes/attention_kernel.cu -o "$ak" || exit 1
fi
da=${JC_DECODE_ATTENTION_PROBE:-}
if [ -z "$da" ] && wanted decode_attention; then
  da=/tmp/decode_attention_sanitize
  nvcc "${nvcc_flags[@]}" benchmarks/probes/decode_attention_kernel.cu -o "$da" || exit 1
fi
ml=${JC_MLA_PROBE:-}
if [ -z "$ml" ] && wanted mla_decode; then
  ml=/tmp/mla_decode_sanitize
  nvcc "${nvcc_flags[@]}" benchmarks/probes/mla_decode_kernel.cu cpp/ops/mla_decode/cpu.cc -o "$ml" || exit 1
fi
mp=${JC_MLA_PROJ_PROBE:-}
if [ -z "$mp" ] && wanted mla_projections; then
  mp=/tmp/mla_projections_sanitize
  nvcc "${nvcc_flags[@]}" benchmarks/probes/mla_projections_kernel.cu cpp/ops/mla_decode/cpu.cc -o "$mp" || exit 1
fi
mo=${JC_MOE_PROBE:-}
if [ -z "$mo" ] && wanted moe_decode; then
  mo=/tmp/moe_decode_sanitize
  nvcc "${nvcc_flags[@]}" benchmarks/probes/moe_decode_kernel.cu cpp/ops/moe_decode/cpu.cc -o "$mo" || exit 1
fi
mr=${JC_ROUTE_PROBE:-}
if [ -z "$mr" ] && wanted moe_route; then
  mr=/tmp/moe_route_sanitize
  nvcc "${nvcc_flags[@]}" benchmarks/probes/moe_route_kernel.cu cpp/ops/moe_decode/cpu.cc -o "$mr" || exit 1
fi
dl=${JC_LAYER_PROBE:-}
if [ -z "$dl" ] && wanted decoder_layer; then
  dl=/tmp/decoder_layer_sanitize
  nvcc "${nvcc_flags[@]}" benchmarks/probes/decoder_layer_kernel.cu cpp/ops/decoder_layer/cpu.cc -o "$dl" || exit 1
fi

# attention_block: D Hq Hkv Dh ctx batch cluster heads_per_cluster [variant]: every kernel
# (SplitToken with the register and the TMA pipeline, SplitHead), head_dim 64/80/96/128/256,
# MHA/GQA/MQA, cluster sizes 1/2/3/4/5/8/16, batch 1-8 with ragged lengths (row 0 at the
# first token).
ak_configs=(
  "4096 32 8 128 1024 1 8 2"
  "4096 32 32 128 1024 1 3 1"
  "1024 16 4 64 300 3 4 2"
  "1280 16 16 80 77 2 5 1"
  "1536 16 2 96 129 3 2 8"
  "1024 8 8 128 33 1 16 1"
  "512 8 1 64 17 3 1 8"
  "4096 32 8 128 512 8 4 2"
  "4096 32 8 128 1024 1 8 2 tma"
  "1024 16 4 64 300 3 4 2 tma"
  "1280 16 16 80 77 2 2 1 tma"
  "1024 16 4 64 300 3 4 2 split_head"
  "2048 16 16 128 200 2 4 1 split_head"
  "2048 8 8 256 300 2 4 1"
  "1024 8 1 256 200 3 2 8"
  "1024 8 8 256 100 1 4 1 split_head"
)
# decode_attention: B Hkv G Dh S_max splits: the tensor-core kernel (G >= 2) with and without
# token splits (merge kernel), head_dim 64/80/96/128, and the CUDA-core kernel (MHA, G = 1);
# at head_dim 256 both (the tensor-core one in its lean form, the merge looping over entries).
da_configs=(
  "3 2 3 80 300 5"
  "2 2 4 128 300 1"
  "2 2 8 64 200 3"
  "1 4 4 96 100 1"
  "2 4 1 64 129 4"
  "2 2 1 256 300 4"
  "2 1 8 256 200 3"
  "1 2 2 256 100 1"
)
# mla_decode: B H r dr S_max splits page (0: contiguous): V2-Lite's 16 heads, V2's 128 (8
# head tiles writing the same new token), a small rank (the padded kernel), one split and
# several (merge kernel; 70: more splits than a lane's first pass), 64- and 16-token pages.
ml_configs=(
  "3 16 512 64 300 1 0"
  "2 16 512 64 300 4 64"
  "1 16 512 64 2300 70 64"
  "1 128 512 64 200 2 0"
  "2 20 32 8 100 3 16"
)
# mla_projections: B H hidden q_lora r dn dr dv: V2-Lite at 1 and 3 rows, V2 (q LoRA, 128
# heads), and a small shape at the 8-row limit whose widths are off every power of two.
mp_configs=(
  "1 16 2048 0 512 128 64 128"
  "3 16 2048 0 512 128 64 128"
  "2 128 5120 1536 512 128 64 128"
  "8 20 96 40 136 24 24 8"
)
# moe_decode: N H I E k Is: one pass per expert at 1-4 rows, several at 9 and 17 (8-row
# passes), shared experts of one chunk and of several (the last narrower; 10: two of the
# combine's load batches), odd widths.
mo_configs=(
  "1 512 264 16 6 528"
  "3 520 264 10 3 272"
  "9 512 264 16 4 0"
  "17 264 136 6 2 408"
  "2 64 8 6 2 80"
)
# moe_route: N H E k method norm router: V2-Lite's router with and without the norm, 8
# rows, a small H of 8-row chunks, V3's and V2's (many chunks), router rows off the 16-byte
# grid (E 20 bf16: one element per load).
mr_configs=(
  "2 256 20 4 greedy 1 bf16"
  "1 2048 64 6 greedy 1 f32"
  "8 2048 64 6 greedy 0 f32"
  "3 64 16 4 grouped 1 bf16"
  "1 7168 256 8 noaux 1 bf16"
  "5 5120 160 6 grouped 0 bf16"
)
# decoder_layer: family B D F Hq Hkv Dh S_max: one token split and several (merge phase), GQA
# 4/8 and MHA, head_dim 64/80/96/128/256, both residuals, widths off the tiles, batch 1-8.
dl_configs=(
  "llama 1 512 1376 8 2 64 48"
  "llama 3 320 520 16 2 80 600"
  "neox 2 384 1536 4 4 96 300"
  "neox_seq 3 240 456 4 4 80 600"
  "llama 8 256 688 4 4 128 100"
  "neox 2 512 2048 2 2 256 300"
  "llama 1 512 1024 8 1 256 600"
)
failed=0
check() {  # check LABEL CMD...: each tool over one configuration
  local label=$1; shift
  [[ -n "${ONLY:-}" && "$label" != *"$ONLY"* ]] && return  # ONLY=tma: those configurations
  for tool in memcheck racecheck; do
    extra=()
    [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
    out=$(timeout 300 compute-sanitizer --tool "$tool" "${extra[@]}" "$@" 2>&1)
    rc=$?
    summary=$(echo "$out" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY" | tail -n 1)
    if [ $rc -ne 0 ] || ! echo "$summary" | grep -qE "SUMMARY: (0 errors|0 hazards displayed \(0 errors, 0 warnings\))$"; then
      failed=1
      echo "FAIL $tool [$label] rc=$rc"
      echo "$out" | tail -n 30
    else
      echo "ok   $tool [$label] ${summary#========= }"
    fi
  done
}
export AK_STEPS=1 AK_RAGGED=1
for cfg in "${ak_configs[@]}"; do
  check "attention_block $cfg" "$ak" $cfg
done
for cfg in "${da_configs[@]}"; do
  check "decode_attention $cfg" "$da" $cfg
  DA_APPEND=1 check "decode_attention append $cfg" "$da" $cfg
  DA_APPEND=1 DA_ROLLING=1 check "decode_attention rolling $cfg 7" "$da" $cfg 7  # a middle slot skipped
done
for cfg in "${ml_configs[@]}"; do
  check "mla_decode $cfg" "$ml" $cfg
done
for cfg in "${mp_configs[@]}"; do
  check "mla_projections $cfg" "$mp" $cfg
done
for cfg in "${mo_configs[@]}"; do
  MOE_PDL=0 check "moe_decode $cfg" "$mo" $cfg  # racecheck does not follow programmatic launches
done
for cfg in "${mr_configs[@]}"; do
  MOE_PDL=0 check "moe_route $cfg" "$mr" $cfg
done
for cfg in "${dl_configs[@]}"; do
  check "decoder_layer $cfg" "$dl" $cfg
done
for cfg in "${dl_configs[1]}" "${dl_configs[2]}" "${dl_configs[4]}"; do  # rows wrapped past a rolling buffer
  LAYER_ROLLING=1 check "decoder_layer rolling $cfg" "$dl" $cfg
done
exit $failed
