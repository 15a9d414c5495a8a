"""decoder_layer: one decode step of a whole layer, per implementation, against its byte floor.

Columns per case (model, batch, context): one_launch = jax_cluster.decoder_layer(impl="cuda")
(the one-launch layer kernel; blank where it does not cover the shapes, e.g. batch > 8);
per_op = impl="auto" (the layer on the per-op kernels, each op's tuner
picking its configuration); xla = the same layer in plain jnp (impl="xla"). A call runs
STEPS decode steps of LAYERS layers (each with its own weights and KV cache, so weights do not
stay in L2), written out in one jit with the state donated. floor = the bytes a layer step
must read (its weights + the K/V cache up to the context + x, y) / the HBM bandwidth measured
in the same run.

Models: pythia-2.8b, pythia-6.9b (GPT-NeoX: LayerNorm, biases, partial rotary, GeLU, parallel
residual), llama-2-7b, llama-3-8b, llama-3.2-1b (RMSNorm, GQA, SwiGLU).
Run: python benchmarks/decoder_layer.py [--models ...] [--combos 1:4096,16:4096] [--dtype fp16]
     python benchmarks/decoder_layer.py --tiny      (a smoke check of the script on any backend)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_cluster as jc
from common import dtype_tag, measure_bandwidth, time_donated, write_results

# family, hidden, q heads, kv heads, head dim, MLP width, rotary dim
MODELS = {
    "pythia-1b": ("gpt_neox", 2048, 8, 8, 256, 8192, 64),
    "pythia-2.8b": ("gpt_neox", 2560, 32, 32, 80, 10240, 20),
    "pythia-6.9b": ("gpt_neox", 4096, 32, 32, 128, 16384, 32),
    "llama-2-7b": ("llama", 4096, 32, 32, 128, 11008, 128),
    "llama-3-8b": ("llama", 4096, 32, 8, 128, 14336, 128),
    "llama-3.2-1b": ("llama", 2048, 32, 8, 64, 8192, 64),
    "tiny-llama": ("llama", 128, 4, 2, 32, 256, 32),
    "tiny-pythia": ("gpt_neox", 128, 4, 4, 32, 256, 8),
}
COMBOS = ((1, 1024), (1, 4096), (16, 4096))
STEPS, LAYERS = 2, 4
IMPLS = {"one_launch": dict(impl="cuda"), "per_op": dict(impl="auto"), "xla": dict(impl="xla")}
COLUMNS = ["case", "one_launch_us", "per_op_us", "xla_us", "floor_us", "one_launch_floor_fraction",
           "per_op_floor_fraction", "xla_floor_fraction", "one_launch_vs_per_op", "one_launch_vs_xla"]


def layer_weights(key, family, d, hq, hkv, dh, f, dtype):
    ks = iter(jax.random.split(key, 8))

    def m(*shape):
        return (jax.random.normal(next(ks), shape, jnp.float32) * shape[0] ** -0.5).astype(dtype)

    w = dict(norm=jnp.ones((d,), dtype), qkv=m(d, (hq + 2 * hkv) * dh), o=m(hq * dh, d),
             post_norm=jnp.ones((d,), dtype))
    if family == "llama":
        w.update(w_gate=m(d, f), w_up=m(d, f), w_down=m(f, d))
    else:
        zeros = lambda n: jnp.zeros((n,), dtype)  # noqa: E731
        w.update(norm_bias=zeros(d), post_norm_bias=zeros(d), qkv_bias=zeros((hq + 2 * hkv) * dh), o_bias=zeros(d),
                 w_in=m(d, f), b_in=zeros(f), w_out=m(f, d), b_out=zeros(d))
    return w


def timed(impl, model, state, ws, lengths, inv_freq):
    family, d, hq, hkv, dh, f, rot = MODELS[model]
    kw = dict(family=family, num_q_heads=hq, num_kv_heads=hkv, eps=1e-5, rotary_dim=rot, **IMPLS[impl])
    if family == "gpt_neox":
        kw["parallel_residual"] = True

    def run(s, ws):
        x, caches = s
        for _ in range(STEPS):
            new = []
            for w, (kc, vc) in zip(ws, caches):
                x, kc, vc = jc.decoder_layer(x, w, kc, vc, lengths, inv_freq, **kw)
                new.append((kc, vc))
            caches = tuple(new)
        return x, caches

    return time_donated(run, state, ws) / (STEPS * len(ws)) * 1e6


def bench_case(model, batch, ctx, dtype, bandwidth, rng):
    family, d, hq, hkv, dh, f, rot = MODELS[model]
    ws = tuple(layer_weights(k, family, d, hq, hkv, dh, f, dtype) for k in jax.random.split(jax.random.key(0), LAYERS))
    lengths = jnp.full((batch,), ctx - 1, jnp.int32)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, rot, 2) / rot), jnp.float32)
    x0 = rng.standard_normal((batch, d))

    def fresh():
        caches = tuple(tuple(jnp.asarray(rng.standard_normal((batch, hkv, ctx, dh)) * 0.5, dtype) for _ in range(2))
                       for _ in range(LAYERS))
        return jnp.asarray(x0, dtype), caches

    us = {}
    for impl in IMPLS:
        try:
            us[impl] = timed(impl, model, fresh(), ws, lengths, inv_freq)
        except ValueError as e:  # the one-launch kernel does not cover these shapes
            print(f"  {impl}: {e}", flush=True)
    item = jnp.dtype(dtype).itemsize
    w_bytes = sum(int(np.prod(a.shape)) * item for a in ws[0].values())
    nbytes = w_bytes + 2 * batch * hkv * ctx * dh * item + 2 * batch * d * item
    floor = nbytes / bandwidth * 1e6
    row = {"case": f"{model}_b{batch}_ctx{ctx}_{dtype_tag(dtype)}", "floor_us": round(floor, 2)}
    for impl, t in us.items():
        row[f"{impl}_us"] = round(t, 2)
        row[f"{impl}_floor_fraction"] = round(floor / t, 3)
    if "one_launch" in us:
        row["one_launch_vs_per_op"] = round(us["per_op"] / us["one_launch"], 3)
        row["one_launch_vs_xla"] = round(us["xla"] / us["one_launch"], 3)
    print(row, flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=[m for m in MODELS if not m.startswith("tiny")])
    ap.add_argument("--combos", default=None, help="batch:context pairs, e.g. 1:4096,16:4096")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--tiny", action="store_true", help="smoke check: tiny layers, short contexts, any backend")
    ap.add_argument("--part", default=None)
    a = ap.parse_args()
    dtype = jnp.float16 if a.dtype == "fp16" else jnp.bfloat16
    models, combos, name = a.models, COMBOS, "decoder_layer"
    if a.tiny:
        models, combos, name = ["tiny-llama", "tiny-pythia"], ((1, 64), (3, 96)), "decoder_layer_tiny"
    if a.combos:
        combos = [tuple(map(int, c.split(":"))) for c in a.combos.split(",")]
    bandwidth = measure_bandwidth(0.0625 if a.tiny else 1.0)
    rng = np.random.default_rng(0)
    cases = [(m, b, c) for m in models for b, c in combos]
    notes = ("us per layer step (STEPS x LAYERS written out in one jit, state donated); one_launch = decoder_layer "
             "impl=cuda (the one-launch layer kernel; blank where it does not cover the shapes); per_op = impl=auto "
             "(attention_block + swiglu kernels, GeLU MLPs on XLA); floor = (layer weights + K/V cache + x, y) bytes "
             "/ measured HBM bandwidth.")
    rows = []
    for i, (m, b, c) in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {m} b{b} ctx{c}", flush=True)
        rows.append(bench_case(m, b, c, dtype, bandwidth, rng))
        # after every case: a run cut short keeps what it measured
        write_results(name, rows, columns=COLUMNS, part=a.part, notes=notes)


if __name__ == "__main__":
    main()
