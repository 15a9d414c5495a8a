"""swiglu: DeepFusionKernel's fused SwiGLU MLP, its tuner, and its tensor-parallel form.

    A2 = silu(x @ w_gate) * (x @ w_up)          [M, F]  (rounded to x.dtype)
    y  = A2 @ w_down (+ residual)               [M, D]

x [..., D]; w_gate, w_up [D, F]; w_down [F, D] or None (then A2 is returned, the fused
"up" stage alone). The kernels take fp16 / bf16 with fp32 accumulation and D, F multiples
of 64. `impl` has the meaning of every op (docs/architecture.md): "auto" the tuner's pick
among SwigluConfig candidates and "xla" (shapes without a kernel run "xla" with a one-time
warning), "cuda" the custom call (the C++ handler on CPU), "xla" XLA's dots in the input
dtype, "reference" the fp32 jnp reference.

SwigluConfig picks the kernels (cpp/ops/swiglu/params.h has the details, docs/swiglu.md
what was measured and what lost):
  variant="tma"    (default) each GEMM one persistent stream-K kernel fed by the bulk
                   tensor copy engine, any M.
  variant="gemv"   M <= 16 per call (more rows run in 16-row chunks): weights streamed
                   into registers and fed to mma.sync as the transposed operand.
  variant="fused"  DeepFusionKernel's single deeply fused kernel (A2 never leaves the
                   chip; with w_down only): the paper's method, slower than "tma" at every
                   measured shape, kept as the documented alternative.
  down="xla"       our up stage writes A2, then XLA's dot does the down GEMM (+ residual).

Tensor parallelism (DeepFusionKernel App. A.1): :func:`swiglu_tp` shards w_gate / w_up by
columns and w_down by rows over a mesh axis; each device runs the op on its shard and a
single psum combines the outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster import _extension, reference, tuning
from jax_cluster._ffi import (check_array, check_call, ffi_primitive, num_sms,
                              on_gpu, warn_once)
from jax_cluster._sharding import row_partitioned
from jax_cluster.ops._swiglu_timing import timing_inputs, timing_loop

__all__ = ["SwigluConfig", "autotune", "candidates", "heuristic", "launch_plan", "measure",
           "swiglu", "swiglu_tp", "timing_inputs", "timing_loop", "tuning_key"]

VARIANTS = ("tma", "gemv", "fused")
DOWNS = ("kernel", "xla")
ROW_TILES = (1, 2, 4)
CLUSTER_SIZES = (1, 2, 4, 8, 16)
# The knobs of each variant (a knob set for another variant is an error).
_KNOBS = {"row_tiles": ("tma", "fused"), "blocks": ("tma",), "k_splits_up": ("gemv",),
          "k_splits_down": ("gemv",), "cluster_size": ("fused",), "f_group": ("fused",),
          "clusters": ("fused",)}
# Bump when the kernels, the candidates or how they are timed change: cached picks are
# re-measured.
KERNEL_VERSION = 14


@dataclasses.dataclass(frozen=True)
class SwigluConfig:
    """How swiglu runs on the GPU (impl="auto" or "cuda"). None: the default for the shape.

    variant        "tma", "gemv" or "fused" (see the module docstring).
    down           "kernel" (our down GEMM) or "xla" (XLA's dot after our up stage).
    row_tiles      tma, fused: 16-row mma tiles per block, 1, 2 or 4 (default: the fewest
                   that hold M, at most 4; more rows are more row groups).
    blocks         tma: at most this many blocks per kernel (default: one per SM; fewer
                   split more tiles between blocks).
    pdl            tma, gemv: the down kernel launches programmatically (it streams its
                   first weights while the up kernel drains).
    k_splits_up, k_splits_down
                   gemv: K chunks of each GEMM (default: as many as keep every block
                   resident in one wave), at most K / 16.
    cluster_size   fused: blocks per cluster, 1, 2, 4, 8 or 16 (default 8), at most D / 64.
    f_group        fused: 64-column F tiles per DSMEM exchange (default 2), at most F / 64.
    clusters       fused: clusters of the persistent grid (default: balanced over the F
                   tiles), at most F / 64.
    Values above a shape's limit are clamped to it; a fused configuration that does not fit
    shared memory is an error.
    """

    variant: str = "tma"
    down: str = "kernel"
    row_tiles: int | None = None
    blocks: int | None = None
    pdl: bool = True
    k_splits_up: int | None = None
    k_splits_down: int | None = None
    cluster_size: int | None = None
    f_group: int | None = None
    clusters: int | None = None

    def __post_init__(self):
        def bad(message):
            raise ValueError(f"SwigluConfig: {message}")

        if self.variant not in VARIANTS:
            bad(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.down not in DOWNS:
            bad(f"down must be one of {DOWNS}, got {self.down!r}")
        if not isinstance(self.pdl, bool):
            raise TypeError(f"SwigluConfig: pdl must be a bool, got {self.pdl!r}")
        for name, owners in _KNOBS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SwigluConfig: {name} must be an int or None, got {value!r}")
            if self.variant not in owners:
                bad(f"{name} is a knob of variant {' or '.join(map(repr, owners))}, "
                    f"not {self.variant!r}")
        ranges = {"blocks": (1, 65535), "k_splits_up": (1, None), "k_splits_down": (1, None),
                  "f_group": (1, 64), "clusters": (1, 65535)}
        for name, (lo, hi) in ranges.items():
            value = getattr(self, name)
            if value is not None and (value < lo or (hi is not None and value > hi)):
                bad(f"{name} must be {'>= ' + str(lo) if hi is None else f'in {lo}..{hi}'}, "
                    f"got {value}")
        if self.row_tiles is not None and self.row_tiles not in ROW_TILES:
            bad(f"row_tiles must be one of {ROW_TILES}, got {self.row_tiles}")
        if self.cluster_size is not None and self.cluster_size not in CLUSTER_SIZES:
            bad(f"cluster_size must be one of {CLUSTER_SIZES}, got {self.cluster_size}")
        if self.variant == "fused" and not self.pdl:
            bad("pdl is a knob of 'tma' and 'gemv' (the fused variant is one kernel)")
        if self.variant == "fused" and self.down == "xla":
            bad("the fused variant runs the whole MLP in one kernel: down must be 'kernel'")


# ----------------------------------------------------------------------------- launch plan
def _plans():
    return _extension.plans()


def _max_rows(variant: str) -> int | None:
    """Rows of one call of the variant (larger M runs in chunks); None: any M."""
    if variant == "gemv":
        return int(_plans().SWIGLU_GEMV_MAX_ROWS)
    if variant == "fused":
        return int(_plans().SWIGLU_FUSED_MAX_ROWS)
    return None


def supported(d: int, f: int, dtype) -> bool:
    """Whether the kernels (CPU handler and CUDA) take these sizes and dtype."""
    align = int(_plans().SWIGLU_ALIGN)
    return (d % align == 0 and f % align == 0
            and jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)))


@functools.lru_cache(maxsize=None)
def _plan(config: SwigluConfig, m: int, d: int, f: int, dtype: str, has_down: bool,
          sms: int) -> dict:
    knobs = {k: getattr(config, k) or 0 for k in _KNOBS}
    return dict(_plans().swiglu(config.variant, m, d, f, dtype, has_down, sms, pdl=config.pdl,
                                **knobs))


def launch_plan(config: SwigluConfig, m: int, d: int, f: int, dtype, *,
                has_down: bool = True) -> dict:
    """The FFI attributes and workspace bytes one call of `m` rows runs with on this
    machine's GPU (cpp/ops/swiglu/plan.cc); ValueError when the kernels cannot run it."""
    return dict(_plan(config, m, d, f, jnp.dtype(dtype).name, has_down, num_sms()))


# ----------------------------------------------------------------------------- primitive
def _abstract(x, w_gate, w_up, w_down, residual, *, variant, row_tiles, blocks, clusters,
              cluster_size, f_group, k_splits_up, k_splits_down, pdl, has_down, has_residual):
    del w_up, w_down, residual, pdl, has_residual
    m, d = x.shape
    f = w_gate.shape[1]
    ws = _plans().swiglu_workspace_bytes(variant, m, d, f, jnp.dtype(x.dtype).name, has_down,
                                         row_tiles, blocks, clusters, cluster_size, f_group,
                                         k_splits_up, k_splits_down)
    return ShapedArray((m, d if has_down else f), x.dtype), ShapedArray((ws,), np.uint8)


def _batching(args, dims, **params):
    """vmap: fold the mapped axis into M when only x / residual are mapped and the variant
    takes any M (tma); otherwise map over the batch sequentially."""
    x, w_gate, w_up, w_down, residual = args
    bx, bg, bu, bd, br = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if bg is None and bu is None and bd is None and _max_rows(VARIANTS[params["variant"]]) is None:
        def fold(a, d):
            a = jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
            return a.reshape((size * a.shape[1],) + a.shape[2:])

        res = fold(residual, br) if params["has_residual"] else residual
        out, ws = _PRIM.bind(fold(x, bx), w_gate, w_up, w_down, res, **params)
        return (out.reshape((size, out.shape[0] // size) + out.shape[1:]), ws), (0, None)
    moved = [jnp.moveaxis(a, d, 0) if d is not None else a for a, d in zip(args, dims)]

    def one(i):
        return _PRIM.bind(*[a[i] if d is not None else a for a, d in zip(moved, dims)], **params)[0]

    out = jax.lax.map(one, jnp.arange(size))
    return (out, jnp.zeros((0,), np.uint8)), (0, None)


_PRIM = ffi_primitive("swiglu", abstract_eval=_abstract, batching_rule=_batching)


def _bind(x2, w_gate, w_up, w_down, residual2, attrs: dict):
    has_down, has_res = w_down is not None, residual2 is not None
    empty = jnp.zeros((0,), x2.dtype)
    out, _ = _PRIM.bind(x2, w_gate, w_up, w_down if has_down else empty,
                        residual2 if has_res else empty, has_down=has_down,
                        has_residual=has_res, **attrs)
    return out


def _xla_mlp(x2, w_gate, w_up, w_down, residual2):
    """What a JAX user writes: XLA's dots in the input dtype (fp32 accumulation inside, a
    16-bit result, as the jnp peer), SiLU*mul in fp32."""
    g, u = x2 @ w_gate, x2 @ w_up
    a2 = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x2.dtype)
    return a2 if w_down is None else _xla_down(a2, w_down, residual2)


def _xla_down(a2, w_down, residual2):
    y = a2 @ w_down
    if residual2 is not None:
        y = (y.astype(jnp.float32) + residual2.astype(jnp.float32)).astype(a2.dtype)
    return y


def _run(x2, w_gate, w_up, w_down, residual2, choice):
    """One [M, D] call of a candidate: "xla" or a SwigluConfig."""
    if choice == "xla":
        return _xla_mlp(x2, w_gate, w_up, w_down, residual2)
    if w_down is not None and choice.down == "xla":
        a2 = _run(x2, w_gate, w_up, None, None, dataclasses.replace(choice, down="kernel"))
        return _xla_down(a2, w_down, residual2)
    m, d = x2.shape
    rows = _max_rows(choice.variant)
    if rows is not None and m > rows:  # gemv: its row limit; fused: a bounded workspace
        outs = []
        for r0 in range(0, m, rows):
            res = None if residual2 is None else residual2[r0:r0 + rows]
            outs.append(_run(x2[r0:r0 + rows], w_gate, w_up, w_down, res, choice))
        return jnp.concatenate(outs, axis=0)
    attrs = launch_plan(choice, m, d, w_gate.shape[1], x2.dtype, has_down=w_down is not None)
    attrs.pop("workspace_bytes")
    return _bind(x2, w_gate, w_up, w_down, residual2, attrs)


def _no_kernel_reason(d: int, f: int, dtype) -> str:
    align = int(_plans().SWIGLU_ALIGN)
    if d % align or f % align:
        return f"D={d}, F={f} (the kernels need multiples of {align})"
    return f"dtype {jnp.dtype(dtype).name} (the kernels take float16 or bfloat16)"


def _validate(x, w_gate, w_up, w_down, residual):
    if x.ndim < 1:
        raise ValueError("swiglu: x must be [..., D], got a scalar")
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16),
                                  jnp.dtype(jnp.float32)):
        raise ValueError(f"swiglu: x dtype must be float16 or bfloat16 (float32 has no kernel: "
                         f"impl='auto' runs it on XLA), got {jnp.dtype(x.dtype).name}")
    d = x.shape[-1]
    if w_gate.ndim != 2 or w_gate.shape[0] != d:
        raise ValueError(f"swiglu: w_gate must be [D, F] with D = x.shape[-1] = {d}, got shape "
                         f"{tuple(w_gate.shape)}")
    f = w_gate.shape[1]
    check_array("swiglu", "w_gate", w_gate, (d, f), x.dtype)
    check_array("swiglu", "w_up", w_up, (d, f), x.dtype)
    check_array("swiglu", "w_down", w_down, (f, d), x.dtype)
    if residual is not None:
        if w_down is None:
            raise ValueError("swiglu: residual needs w_down (the up stage alone returns [..., F])")
        check_array("swiglu", "residual", residual, x.shape, x.dtype)
    if d < 1 or f < 1:
        raise ValueError(f"swiglu: D and F must be positive, got D={d}, F={f}")
    return d, f


def swiglu(x, w_gate, w_up, w_down=None, residual=None, *, impl: str = "auto",
           config: SwigluConfig | None = None):
    """Fused SwiGLU MLP: (silu(x @ w_gate) * (x @ w_up)) @ w_down (+ residual).

    x [..., D]; w_gate, w_up [D, F]; w_down [F, D] or None (returns A2 [..., F]);
    residual [..., D] or None (added in fp32 before the single rounding of y).
    impl: "auto", "cuda", "xla" or "reference" (module docstring). config: a SwigluConfig
    run exactly (impl "auto" or "cuda"); None: the tuner's pick for impl="auto", the
    default SwigluConfig() for impl="cuda".
    """
    check_call("swiglu", impl, config, SwigluConfig)
    d, f = _validate(x, w_gate, w_up, w_down, residual)
    if impl == "reference":
        return reference.swiglu(x, w_gate, w_up, w_down, residual)
    lead = tuple(x.shape[:-1])
    m = math.prod(lead)
    out_cols = d if w_down is not None else f
    x2 = x.reshape(m, d)
    res2 = None if residual is None else residual.reshape(m, d)
    dtype = jnp.dtype(x.dtype)
    if impl == "auto" and not supported(d, f, dtype):
        warn_once(("swiglu", d, f, dtype.name),
                  f"swiglu: no kernel for {_no_kernel_reason(d, f, dtype)}; running impl='xla'")
        impl = "xla"
    if impl == "xla":
        return _xla_mlp(x2, w_gate, w_up, w_down, res2).reshape(lead + (out_cols,))
    if not supported(d, f, dtype):
        raise ValueError(f"swiglu: impl='cuda' has no kernel for {_no_kernel_reason(d, f, dtype)}")
    if m == 0:
        return jnp.zeros(lead + (out_cols,), x.dtype)
    has_down = w_down is not None
    if config is not None:
        choice = config
    elif impl == "auto":
        choice = _pick(m, d, f, dtype, has_down)
    else:
        choice = heuristic(m, has_down)
    if choice == "xla":
        return _xla_mlp(x2, w_gate, w_up, w_down, res2).reshape(lead + (out_cols,))
    run = lambda *a: (_run(*a, choice),)  # noqa: E731
    y, = row_partitioned(run, (True, False, False, False, True), (True,))(x2, w_gate, w_up, w_down, res2)
    return y.reshape(lead + (out_cols,))


# ----------------------------------------------------------------------------- tuning
def heuristic(m: int, has_down: bool):
    """The fixed choice when tuning is off (JAX_CLUSTER_TUNING=0) or on CPU: our fastest
    kernel at every measured M (docs/swiglu.md)."""
    del m, has_down
    return SwigluConfig()


def candidates(m: int, has_down: bool) -> list:
    """What the tuner measures for one shape: the tma kernels; the gemv kernels within their
    row limit; with the down GEMM also our up stage before XLA's down dot; XLA's dots
    (so "auto" is never slower than plain XLA where our kernels lose). Variants that lost
    at every measured shape are not measured (each costs a compilation and a timing)."""
    out = [SwigluConfig()]
    if m <= _max_rows("gemv"):
        out.append(SwigluConfig(variant="gemv"))
    if has_down:
        out.append(SwigluConfig(down="xla"))
    return out + ["xla"]


def _m_bucket(m: int) -> int:
    return 1 << max(0, (max(1, m) - 1).bit_length())


def tuning_key(m: int, d: int, f: int, dtype, has_down: bool) -> str:
    return tuning.make_key(KERNEL_VERSION, m=_m_bucket(m), d=d, f=f, dtype=jnp.dtype(dtype).name,
                           stage="mlp" if has_down else "up")


def measure(choice, *, m: int, d: int, f: int, dtype, has_down: bool = True) -> float:
    """Seconds per call of `choice` ("xla" or a SwigluConfig) on the default device (fresh
    random inputs; calls chained directly, as the benchmark times them)."""
    inputs = timing_inputs(m, d, f, dtype, has_down=has_down)
    kwargs = dict(impl="xla") if choice == "xla" else dict(impl="cuda", config=choice)
    run, calls = timing_loop(lambda x, wg, wu, wd, res: swiglu(x, wg, wu, wd, res, **kwargs),
                             inputs, chain="direct")
    return tuning.time_call(run, *inputs) / calls


def _pick(m: int, d: int, f: int, dtype, has_down: bool):
    fallback = heuristic(m, has_down)
    if not on_gpu():
        return fallback  # nothing to tune: the CPU handler computes the same math
    return tuning.pick("swiglu", tuning_key(m, d, f, dtype, has_down), candidates(m, has_down),
                       functools.partial(measure, m=m, d=d, f=f, dtype=dtype, has_down=has_down),
                       heuristic=fallback)


def autotune(m: int, d: int, f: int, dtype, *, has_down: bool = True):
    """Runs the tuner now for one shape (e.g. at deployment warm-up); returns what
    impl="auto" will run for it: a SwigluConfig or "xla"."""
    return _pick(m, d, f, jnp.dtype(dtype), has_down)


# ----------------------------------------------------------------------------- tensor parallel
def swiglu_tp(x, w_gate, w_up, w_down, residual=None, *, mesh, axis: str = "tp",
              impl: str = "auto", config: SwigluConfig | None = None, psum_dtype=None):
    """Tensor-parallel SwiGLU MLP (DeepFusionKernel App. A.1) over mesh axis `axis`.

    w_gate / w_up are split by columns and w_down by rows (P(None, axis) and P(axis, None));
    x is replicated. Each device runs the op (impl, config) on its F-shard (the
    gate/up/SiLU/down chain stays local) and ONE psum over `axis` combines the partial
    outputs (in x.dtype, or `psum_dtype`); the residual is added after it. F / axis size
    should be a multiple of 64 for the kernels.
    """
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    check_call("swiglu", impl, config, SwigluConfig)
    if w_down is None:
        raise ValueError("swiglu_tp: w_down is required (the up stage alone needs no collective)")
    size = mesh.shape[axis]
    f = w_gate.shape[-1]
    if f % size:
        raise ValueError(f"swiglu_tp: F ({f}) must be divisible by the size of mesh axis "
                         f"{axis!r} ({size})")
    _validate(x, w_gate, w_up, w_down, residual)
    out_dtype = jnp.dtype(psum_dtype) if psum_dtype is not None else jnp.dtype(x.dtype)

    def local(x, wg, wu, wd):
        y = swiglu(x, wg, wu, wd, impl=impl, config=config)
        return jax.lax.psum(y.astype(out_dtype), axis)

    spec_x = P(*([None] * x.ndim))
    y = jax.shard_map(local, mesh=mesh, in_specs=(spec_x, P(None, axis), P(None, axis), P(axis, None)),
                      out_specs=spec_x, check_vma=False)(x, w_gate, w_up, w_down)
    if residual is not None:
        y = y.astype(jnp.float32) + residual.astype(jnp.float32)
    return y.astype(x.dtype)
