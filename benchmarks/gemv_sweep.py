"""Per-call time of swiglu variants with knobs (e.g. the gemv variant's K splits and PDL)
on the default device, fresh random inputs, the benchmarks' timing loop: for choosing
defaults. Each argument is model:M:variant[:knobs].

    python3 benchmarks/gemv_sweep.py llama3-8b:1:gemv llama3-8b:1:gemv:ku=7:kd=37
"""

from __future__ import annotations

import sys

from jax_cluster.ops import swiglu as sw
from swiglu import SHAPES

if __name__ == "__main__":
    for spec in sys.argv[1:]:
        model, m, variant = spec.split(":", 2)
        d, f = SHAPES[model]
        t = sw.measure(variant, m=int(m), d=d, f=f, dtype="float16")
        cfg = sw.make_config(variant, int(m), d, f, True, 132) if variant != "xla" else None
        print(f"{spec:36s} {t * 1e6:7.1f} us  {3 * d * f * 2 / t / 1e12:.2f} TB/s  "
              f"{cfg.describe() if cfg else ''}", flush=True)
