"""linear: a projection y = a @ w (+ residual) on swiglu's weight-streaming GEMM engine.

    y [..., N] = a [..., K] @ w [K, N] (+ residual [..., N])

fp16 / bf16 in, fp32 accumulation, y in a's dtype or float32 (``out_dtype``), the
residual added in fp32 before the one rounding. On a Hopper GPU it is the kernel of
swiglu's "tma" down GEMM (kernels/swiglu_tma.cu): one block per SM, a producer warp
streaming 64 x 64 weight boxes with the bulk tensor copy engine, mma.sync consumers,
equal shares of the (256-column tile, 64-row K block) units; with one row group (M <= 64)
and N / 256 <= SMs / 5 the tiles are owned by clusters of 5-8 blocks that sum their
partials over DSMEM, otherwise split tiles are summed in block order through a workspace
(deterministic either way). The kernel is launched programmatically (PDL): it streams its
first weights while the previous kernel of the stream finishes. Made for the weight-bound
decode regime (M of a few rows to 64). attention_decode's "splitk" step can run its QKV and
output projections on it (projections="linear"), but keeps XLA's dots by default: on H100
(session 24, benchmarks/results/logs/session24/README.md) XLA's GEMMs were as fast or
faster at those 34-100 MB projections (M = 16, K = 4096, per call: N = 4096 13.8-14.4
against 16.4-16.8 us, N = 6144 19.7 against 22.8 us), where this kernel pays a few us of
pipeline ramp and tile sums per call; at M = 1, N = 12288 it was the faster one (71-74
against 76-77 us per pair of projections).

K and N must be multiples of 64 for the kernel; other shapes, float32 inputs and CPU-less
platforms run the jnp reference (with a one-time warning for shapes and dtypes). The CPU
handler is a plain C++ loop (the tests' reference path).
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster import reference
from jax_cluster._ffi import ffi_primitive

ALIGN = 64  # kLinearAlign
TILE_COLS = 256  # kSwigluTmaDownCols: output columns per work tile
SLOT_COLS = 256  # kSwigluTmaSlotCols


def row_tiles(m: int) -> int:
    """16-row mma tiles per block (linear_row_tiles)."""
    return 1 if m <= 16 else 2 if m <= 32 else 4


def workspace_bytes(m: int, n: int, max_blocks: int) -> int:
    """linear_workspace_bytes: tile counters, then an fp32 partial slot per (block, tile)
    segment of a stream-K grid of at most max_blocks blocks."""
    rows = 16 * row_tiles(m)
    tiles = -(-n // TILE_COLS) * -(-m // rows)
    counters = -(-4 * tiles // 16) * 16
    return counters + (max_blocks + tiles - 1) * min(m, rows) * SLOT_COLS * 4


def _abstract(a, w, residual, *, pdl, max_blocks, has_residual, out_f32):
    m, n = a.shape[0], w.shape[1]
    out = ShapedArray((m, n), np.float32 if out_f32 else a.dtype)
    return out, ShapedArray((workspace_bytes(m, n, max_blocks),), np.uint8)


def _batching(args, dims, **params):
    """vmap: with w unmapped the mapped axis folds into M (one call); a mapped w runs one
    call per batch element."""
    a, w, residual = args
    ba, bw, br = dims
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    if bw is None:
        def fold(x, d):
            x = jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
            return x.reshape((size * x.shape[1],) + x.shape[2:])

        res = fold(residual, br) if params["has_residual"] else residual
        out, ws = _PRIM.bind(fold(a, ba), w, res, **params)
        return (out.reshape((size, out.shape[0] // size) + out.shape[1:]), ws), (0, None)
    moved = [jnp.moveaxis(x, d, 0) if d is not None else x for x, d in zip(args, dims)]

    def one(i):
        return _PRIM.bind(*[x[i] if d is not None else x for x, d in zip(moved, dims)], **params)[0]

    return (jax.lax.map(one, jnp.arange(size)), jnp.zeros((0,), np.uint8)), (0, None)


# The kernel's output is a fresh buffer; no operand is aliased.
_PRIM = ffi_primitive("linear", abstract_eval=_abstract, batching_rule=_batching)

_warned: set = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def _num_sms() -> int:
    if jax.default_backend() not in ("gpu", "cuda"):
        return 132
    return int(getattr(jax.devices()[0], "core_count", 132) or 132)


def supported(k: int, n: int, dtype) -> bool:
    """Whether the kernel (CPU handler and CUDA kernel) takes these shapes and dtype."""
    return (k % ALIGN == 0 and n % ALIGN == 0
            and jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)))


def linear(a, w, residual=None, *, out_dtype=None, pdl: bool = True, max_blocks: int | None = None):
    """y = a @ w (+ residual) with fp32 accumulation, rounded once to out_dtype.

    a [..., K]; w [K, N]; residual [..., N] or None (a's dtype); out_dtype None (a's dtype)
    or float32. pdl: launch programmatically (stream the first weights while the previous
    kernel finishes). max_blocks: at most this many blocks (default: the SM count; fewer
    force the stream-K grid with split tiles summed through the workspace, for tests and
    probes). Neither changes the result beyond fp32 summation order.
    """
    if max_blocks is not None and not 1 <= max_blocks <= 65535:
        raise ValueError(f"linear: max_blocks must be in 1..65535, got {max_blocks}")
    if a.ndim < 1 or w.ndim != 2:
        raise ValueError(f"linear: a must be [..., K] and w [K, N], got {a.shape} and {w.shape}")
    k, n = w.shape
    if a.shape[-1] != k:
        raise ValueError(f"linear: a's last dimension ({a.shape[-1]}) must be w's first ({k})")
    if jnp.dtype(w.dtype) != jnp.dtype(a.dtype):
        raise ValueError(f"linear: w must have a's dtype {jnp.dtype(a.dtype).name}, got "
                         f"{jnp.dtype(w.dtype).name}")
    lead = tuple(a.shape[:-1])
    if residual is not None:
        if tuple(residual.shape) != lead + (n,):
            raise ValueError(f"linear: residual must be {lead + (n,)}, got {tuple(residual.shape)}")
        if jnp.dtype(residual.dtype) != jnp.dtype(a.dtype):
            raise ValueError(f"linear: residual must have a's dtype {jnp.dtype(a.dtype).name}, "
                             f"got {jnp.dtype(residual.dtype).name}")
    out_dtype = jnp.dtype(a.dtype if out_dtype is None else out_dtype)
    if out_dtype not in (jnp.dtype(a.dtype), jnp.dtype(jnp.float32)):
        raise ValueError(f"linear: out_dtype must be a's dtype or float32, got {out_dtype.name}")
    if not supported(k, n, a.dtype):
        _warn_once(("shape", k, n, jnp.dtype(a.dtype).name),
                   f"linear: no kernel for K={k}, N={n}, dtype={jnp.dtype(a.dtype).name} (needs K "
                   "and N multiples of 64, float16 or bfloat16); using the jnp reference")
        return reference.linear(a, w, residual, out_dtype)
    m = math.prod(lead)
    if m == 0:
        return jnp.zeros(lead + (n,), out_dtype)
    has_res = residual is not None
    res2 = residual.reshape(m, n) if has_res else jnp.zeros((0,), a.dtype)
    y, _ = _PRIM.bind(a.reshape(m, k), w, res2, pdl=int(pdl),
                      max_blocks=max_blocks or _num_sms(),
                      has_residual=has_res, out_f32=out_dtype == jnp.dtype(jnp.float32))
    return y.reshape(lead + (n,))
