"""How swiglu's tuner and benchmark time a call: inputs that defeat the L2 cache and a
chain of calls inside one jit (private to jax_cluster.ops.swiglu and benchmarks/)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def timing_inputs(m: int, d: int, f: int, dtype, *, has_down: bool = True,
                  has_residual: bool = False, seed: int = 0, l2_bytes: int = 64 << 20):
    """Fresh random inputs (x, weight copies, residual) for timing: N(0, 1) activations,
    weights scaled by 1/sqrt(fan-in), enough copies of the weights that rotating over them
    defeats the L2 cache."""
    dtype = jnp.dtype(dtype)
    wbytes = (3 if has_down else 2) * d * f * dtype.itemsize
    copies = max(1, min(8, -(-2 * l2_bytes // wbytes)))
    keys = jax.random.split(jax.random.key(seed), 3 * copies + 2)

    def normal(k, shape, scale):
        return (jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype)

    x = normal(keys[0], (m, d), 1.0)
    res = normal(keys[1], (m, d), 1.0) if has_residual else None
    weights = tuple(
        (normal(keys[2 + 3 * c], (d, f), d ** -0.5), normal(keys[3 + 3 * c], (d, f), d ** -0.5),
         normal(keys[4 + 3 * c], (f, d), f ** -0.5) if has_down else None)
        for c in range(copies))
    return x, weights, res


def timing_loop(fn, inputs, *, calls: int = 24, chain: str = "fori"):
    """(jitted run(x, weights, res), calls per run): `fn(x, w_gate, w_up, w_down, residual)`
    called many times inside one jit, each call feeding the next (none is dead code),
    rotating over the weight copies of `inputs` (from timing_inputs).

    chain="fori": a lax.fori_loop over rounds of the copies, each call's output added
    into x (x + 1e-3 y: one small XLA kernel per call); chain="direct": the calls unrolled,
    each output y [M, D] IS the next call's x (no kernel but the op's own: what a chain of
    layers costs; up-only calls, whose output is not [M, D], keep the add)."""
    if chain not in ("fori", "direct"):
        raise ValueError(f"chain must be 'fori' or 'direct', got {chain!r}")
    x0, weights, _ = inputs
    reps = max(1, -(-calls // len(weights)))
    dtype = x0.dtype

    def one_round(x, weights, res):
        for wg, wu, wd in weights:
            y = fn(x, wg, wu, wd, res)
            if chain == "direct" and wd is not None:
                x = y
            else:
                feed = y if wd is not None else y[:, :1]
                x = (x.astype(jnp.float32) + 1e-3 * feed.astype(jnp.float32)).astype(dtype)
        return x

    def run(x, weights, res):
        if chain == "direct":
            for _ in range(reps):
                x = one_round(x, weights, res)
            return x
        return jax.lax.fori_loop(0, reps, lambda _, x: one_round(x, weights, res), x)

    return jax.jit(run), reps * len(weights)
