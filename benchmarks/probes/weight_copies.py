"""Probe: the per-step copies of weights in a compiled MLA decode step. A weight whose slice
feeds a batched dot in a layout the backend's dot does not take (W_kv_b's per-head W_uk and
W_uv: [r, H, d] with the batch dimension H in the middle) is copied into one every step, a
kernel and a round trip of its bytes that no roofline counts. Compiles one V2-Lite layer's
step on the default backend, for jax_cluster.mla_decode (impl="cuda", XLA's dots past one
row) and for flax_models' absorbed jnp form, and lists every copy, transpose or fusion of
the entry computation that reads a weight parameter and writes an array of another layout,
with its bytes.
    python benchmarks/probes/weight_copies.py [--batch 1 4] [--ctx 4096]
"""

import argparse
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_cluster as jc
from flax_models.ops import mla_decode_xla

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mla_decode as bench  # noqa: E402

_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\{[^}]*\} (\w+)\((.*?)\)(.*)$")
_PARAM = re.compile(r"^\s*%(\S+) = \w+\[[\d,]*\]\{[^}]*\} parameter\(\d+\), metadata=\{op_name=\"(.*?)\"")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4}


def weight_copies(hlo: str) -> list[tuple[str, str, int]]:
    """(instruction, weight it reads, bytes written) for each copy-like op of ENTRY that reads
    a parameter named after a weight (flax_models' dict keys: w['...'])."""
    entry = hlo[hlo.index("\nENTRY"):]
    params = {m.group(1): m.group(2) for m in map(_PARAM.match, entry.splitlines()) if m}
    weights = {name: op.replace("\\", "") for name, op in params.items() if op.startswith("w[")}
    found = []
    for line in entry.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, dtype, dims, op, operands, _ = m.groups()
        if op not in ("copy", "transpose", "fusion"):
            continue
        if op == "fusion" and not re.search(r"copy|transpose", name):
            continue  # a fusion that computes (a dot, a norm) rather than relays
        read = [weights[o] for o in re.findall(r"%([\w.\-]+)", operands) if o in weights]
        if read:
            elems = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            found.append((name, ", ".join(read), elems * _BYTES.get(dtype, 4)))
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--ctx", type=int, default=4096)
    a = ap.parse_args()
    kw = bench.kwargs()
    w = bench.weights(jax.random.key(0), jnp.bfloat16)
    rope = bench.V2_LITE["qk_rope_head_dim"]
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, rope, 2) / rope), jnp.float32)
    latent = bench.V2_LITE["kv_lora_rank"] + rope
    print(f"backend: {jax.default_backend()}")
    for b in a.batch:
        x = jnp.ones((b, bench.V2_LITE["hidden"]), jnp.bfloat16)
        cache = jnp.zeros((b, a.ctx, latent), jnp.bfloat16)
        lengths = jnp.full((b,), a.ctx - 1, jnp.int32)
        forms = {"mla_decode": (lambda x, w, c, n, f: jc.mla_decode(x, w, c, n, f, impl="cuda", **kw), cache),
                 "absorbed jnp": (lambda x, w, c, n, f: mla_decode_xla(x, w, c, n, f, **kw), cache[:, None])}
        for form, (fn, c) in forms.items():
            hlo = jax.jit(fn).lower(x, w, c, lengths, inv_freq).compile().as_text()
            copies = weight_copies(hlo)
            total = sum(n for *_, n in copies)
            print(f"batch {b}, {form}: {len(copies)} weight copies per step, {total / 1e6:.2f} MB written")
            for name, read, n in copies:
                print(f"    {name}: reads {read}, writes {n / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
