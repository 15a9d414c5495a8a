"""linear: a projection y = a @ w (+ residual) on swiglu's weight-streaming GEMM engine.

    y [..., N] = a [..., K] @ w [K, N] (+ residual [..., N])

fp16 / bf16 in, fp32 accumulation, y in a's dtype or float32 (``out_dtype``), the
residual added in fp32 before the one rounding. On a Hopper GPU it is the kernel of
swiglu's "tma" down GEMM (cpp/ops/swiglu/tma_gemm.h): one block per SM, a producer warp
streaming 64 x 64 weight boxes with the bulk tensor copy engine, mma.sync consumers,
equal shares of the (256-column tile, 64-row K block) units; with one row group (M <= 64)
and N / 256 <= SMs / 5 the tiles are owned by clusters of 5-8 blocks that sum their
partials over DSMEM, otherwise split tiles are summed in block order through a workspace
(deterministic either way). Made for the weight-bound decode regime (M of a few rows to
64); docs/linear.md has what it was measured against.

`impl` has the meaning of every op (docs/architecture.md). linear has no tuner: "auto"
runs the kernel where it covers the shape (K and N multiples of 64, float16 / bfloat16),
"xla" with a one-time warning elsewhere; "cuda" the custom call (the C++ handler on CPU);
"xla" XLA's dot with fp32 accumulation; "reference" the fp32 jnp reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster import _extension, reference
from jax_cluster._ffi import (check_call, ffi_primitive, fold_batch_axis, num_sms,
                              warn_once)
from jax_cluster._sharding import row_partitioned

__all__ = ["LinearConfig", "linear", "supported", "workspace_bytes"]


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    """linear's launch choices (impl "auto" or "cuda"); neither changes the result beyond
    fp32 summation order.

    pdl         launch programmatically: stream the first weights while the previous
                kernel of the stream finishes.
    max_blocks  at most this many blocks (None: one per SM). Fewer force the stream-K grid
                with split tiles summed through the workspace.
    """

    pdl: bool = True
    max_blocks: int | None = None

    def __post_init__(self):
        if not isinstance(self.pdl, bool):
            raise TypeError(f"LinearConfig: pdl must be a bool, got {self.pdl!r}")
        if self.max_blocks is not None:
            if isinstance(self.max_blocks, bool) or not isinstance(self.max_blocks, int):
                raise TypeError(f"LinearConfig: max_blocks must be an int or None, got "
                                f"{self.max_blocks!r}")
            if not 1 <= self.max_blocks <= 65535:
                raise ValueError(f"LinearConfig: max_blocks must be in 1..65535, got {self.max_blocks}")


def workspace_bytes(m: int, n: int, max_blocks: int) -> int:
    """Tile counters, then an fp32 partial slot per (block, tile) segment of a stream-K grid
    of at most max_blocks blocks (cpp/ops/linear/params.h)."""
    return int(_extension.plans().linear_workspace_bytes(m, n, max_blocks))


def supported(k: int, n: int, dtype) -> bool:
    """Whether the kernel (CPU handler and CUDA kernel) takes these shapes and dtype."""
    align = int(_extension.plans().LINEAR_ALIGN)
    return (k % align == 0 and n % align == 0
            and jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)))


def _abstract(a, w, residual, *, pdl, max_blocks, has_residual, out_f32):
    del residual, pdl, has_residual
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
            x = fold_batch_axis(x, d, size)
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


def _xla_linear(a, w, residual, out_dtype):
    """What a JAX user writes: XLA's dot with fp32 accumulation, the residual added in fp32,
    one rounding."""
    y = jnp.matmul(a, w, preferred_element_type=jnp.float32)
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(out_dtype)


def _validate(a, w, residual, out_dtype):
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
    return k, n, out_dtype


def linear(a, w, residual=None, *, out_dtype=None, impl: str = "auto",
           config: LinearConfig | None = None):
    """y = a @ w (+ residual) with fp32 accumulation, rounded once to out_dtype.

    a [..., K]; w [K, N]; residual [..., N] or None (a's dtype); out_dtype None (a's dtype)
    or float32. impl: "auto", "cuda", "xla" or "reference" (module docstring). config: a
    LinearConfig for impl "auto" / "cuda" (None: LinearConfig()).
    """
    check_call("linear", impl, config, LinearConfig)
    k, n, out_dtype = _validate(a, w, residual, out_dtype)
    if impl == "reference":
        return reference.linear(a, w, residual, out_dtype)
    dtype = jnp.dtype(a.dtype)
    if impl == "auto" and not supported(k, n, dtype):
        warn_once(("linear", k, n, dtype.name),
                  f"linear: no kernel for K={k}, N={n}, dtype={dtype.name} (needs K and N "
                  "multiples of 64, float16 or bfloat16); running impl='xla'")
        impl = "xla"
    if impl == "xla":
        return _xla_linear(a, w, residual, out_dtype)
    if not supported(k, n, dtype):
        raise ValueError(f"linear: impl='cuda' needs K and N multiples of 64 and float16 or "
                         f"bfloat16, got K={k}, N={n}, dtype={dtype.name}")
    lead = tuple(a.shape[:-1])
    m = math.prod(lead)
    if m == 0:
        return jnp.zeros(lead + (n,), out_dtype)
    config = config or LinearConfig()
    has_res = residual is not None
    res2 = residual.reshape(m, n) if has_res else jnp.zeros((0,), a.dtype)
    bind = functools.partial(_PRIM.bind, pdl=config.pdl, max_blocks=config.max_blocks or num_sms(),
                             has_residual=has_res, out_f32=out_dtype == jnp.dtype(jnp.float32))
    y, = row_partitioned(lambda *ops: bind(*ops)[:1], (True, False, has_res), (True,))(a.reshape(m, k), w, res2)
    return y.reshape(lead + (n,))
