#!/bin/bash
# Probe: times builds of decoder_layer's one-launch kernel against each other, alternated
# layer by layer so that clock and thermal drift fall on every build alike. Each build is
# benchmarks/probes/decoder_layer_kernel.cu compiled with its own -D flags (the kernel's
# probe knobs, docs/decoder_layer.md); every run also checks the kernel against the CPU
# handler, so a knob that breaks the result shows as "FAIL" (the probe's exit code).
#   VARIANTS="base= seg128=-DJAX_CLUSTER_LAYER_STAGE_SEGMENT_ROWS=128" \
#     [LAYERS="llama 1 2048 8192 32 8 64 1024;..."] [REPS=2] [LAUNCHES=20] \
#     bash benchmarks/probes/ab_decoder_layer.sh
# A variant "name=@/path/to/binary" uses a probe built elsewhere (build on the CPU machine,
# where nvcc costs no GPU time, and carry the binaries). LAYERS: the probe's arguments
# (family B D F Hq Hkv Dh S_max), ';'-separated; the default is five Llama / GPT-NeoX layers
# at batch 1. Prints one line per run, then per layer each build's best time and its ratio
# to the first build's.
set -u
cd "$(dirname "$0")/../.."
nvcc_flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo
            -Icpp -Icpp/include)
VARIANTS=${VARIANTS:-"base="}
LAYERS=${LAYERS:-"llama 1 2048 8192 32 8 64 1024;llama 1 4096 14336 32 8 128 4096;llama 1 4096 11008 32 32 128 4096;neox 1 2560 10240 32 32 80 4096;neox 1 4096 16384 32 32 128 4096"}
names=()
declare -A bin
for v in $VARIANTS; do
  name=${v%%=*}
  spec=${v#*=}
  names+=("$name")
  if [[ "$spec" == @* ]]; then
    bin[$name]=${spec#@}
  else
    bin[$name]=/tmp/decoder_layer_ab_$name
    # shellcheck disable=SC2086  # the flags are words
    nvcc "${nvcc_flags[@]}" $spec benchmarks/probes/decoder_layer_kernel.cu cpp/ops/decoder_layer/cpu.cc \
      -o "${bin[$name]}" &
  fi
done
wait
IFS=';' read -ra layers <<< "$LAYERS"
results=$(mktemp)
for ((rep = 1; rep <= ${REPS:-2}; ++rep)); do
  for cfg in "${layers[@]}"; do
    for name in "${names[@]}"; do
      # shellcheck disable=SC2086  # the probe's arguments are words
      out=$(LAYER_TIME=${LAUNCHES:-20} "${bin[$name]}" $cfg 2>&1)
      rc=$?  # 1: the result differs from the CPU handler's (or a CUDA error), 2: not covered
      us=$(grep -o "timed: [0-9.]* us" <<< "$out" | grep -o "[0-9.]*" || true)
      ok=$([ $rc = 0 ] && echo ok || echo "FAIL(rc=$rc)")
      echo "$rep | $cfg | $name | ${us:-none} us | $ok"
      echo "$cfg|$name|${us:-inf}|$ok" >> "$results"
    done
  done
done
echo
python3 - "$results" "${names[@]}" <<'EOF'
import sys
path, names = sys.argv[1], sys.argv[2:]
best, bad = {}, set()
for line in open(path):
    cfg, name, us, ok = line.rstrip("\n").split("|")
    key = (cfg, name)
    best[key] = min(best.get(key, float("inf")), float(us))
    if ok != "ok":
        bad.add(key)
cfgs = list(dict.fromkeys(c for c, _ in best))
print("| layer | " + " | ".join(f"{n} us" for n in names) + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
print("|---" * (1 + 2 * len(names) - 1) + "|")
for c in cfgs:
    t = [best[(c, n)] for n in names]
    cells = [f"{v:.1f}" + (" FAIL" if (c, n) in bad else "") for v, n in zip(t, names)]
    print(f"| {c} | " + " | ".join(cells) + " | " + " | ".join(f"{v / t[0]:.3f}" for v in t[1:]) + " |")
EOF
rm -f "$results"
