"""Probe: which kernels and Triton tile configs XLA's autotuner picks for plain jnp SwiGLU.

Prints, per (shape, M), the dot fusions of the optimised HLO with their backend config
(Triton block_m/n/k, split_k, stages, warps, or a cuBLAS call). Run on the GPU machine.
"""
import re
import sys

import jax
import jax.numpy as jnp

SHAPES = {"llama2-7b": (4096, 11008), "llama3-8b": (4096, 14336), "70b-tp4": (8192, 7168)}


def swiglu(x, wg, wu, wd):
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def main():
    ms = [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "1,4,16,64").split(",")]
    for name, (d, f) in SHAPES.items():
        for m in ms:
            args = [jax.ShapeDtypeStruct(s, jnp.float16) for s in ((m, d), (d, f), (d, f), (f, d))]
            text = jax.jit(swiglu).lower(*args).compile().as_text()
            print(f"== {name} M={m}")
            for line in text.splitlines():
                if "fusion(" in line or "custom-call(" in line:
                    kind = re.search(r"kind=(\w+)", line)
                    cfg = re.search(r'"(triton_gemm_config|gemm_backend_config|block_level_fusion_config)":(\{[^}]*\})', line)
                    calls = re.search(r"calls=([\w.\-]+)", line)
                    target = re.search(r'custom_call_target="([^"]+)"', line)
                    label = calls.group(1) if calls else (target.group(1) if target else "")
                    if cfg or target:
                        print(f"  {label:32s} {kind.group(1) if kind else '':10s} {cfg.group(2) if cfg else ''}")


if __name__ == "__main__":
    main()
