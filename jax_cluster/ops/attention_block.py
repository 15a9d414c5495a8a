"""attention_block: one decode step of a Llama-family attention block, fused.

    h      = norm(x[b])                        (RMSNorm / LayerNorm / none)
    q,k,v  = h @ w_qkv (+ qkv_bias)            columns [Q heads | K heads | V heads]
    q, k   = rope(q, k, position=lengths[b])   inv_freq given, rotary_dim <= head_dim
    caches[b, :, lengths[b]] = k, v            in place (the caches are aliased outputs)
    o_h    = softmax(scale * q_h . K[:len+1]) V[:len+1]   (GQA: kv head = h // (Hq/Hkv))
    y[b]   = concat(o) @ w_o (+ o_bias) (+ x[b] if residual)

`impl` has the meaning of every op (docs/architecture.md): "auto" the tuner's pick among
AttentionBlockConfig candidates and "xla" (shapes without a kernel run "xla" with a
one-time warning), "cuda" the custom call (the C++ handler on CPU), "xla" XLA's ops in the
input dtype, "reference" the fp32 jnp reference.

AttentionBlockConfig picks how the GPU runs it (docs/attention_block.md has what was
measured):
  kernel="fused"    ONE cluster kernel for the whole block (ClusterFusion Alg. 3) and a
                    tiny deterministic combine. Knobs: cluster_size, heads_per_cluster,
                    dataflow ("split_token", or ClusterFusion's "split_head"), pipeline
                    ("registers" or "tma").
  kernel="split_k"  XLA's projections around our split-K decode attention
                    (jax_cluster.decode_attention_append). Knob: splits.
  kernel="pallas"   XLA's projections around Pallas' decode attention (a peer the tuner
                    weighs; GPU only, shapes of attention_block_unfused.pallas_supported).

Rows whose lengths are outside [0, S_max) (possible only under jit, where the values are
not known at trace time) give NaN outputs and leave the caches untouched; outside jit they
are an error. Donate the caches (jax.jit(..., donate_argnums=...)) so the update happens
in place.
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
from jax_cluster._ffi import (check_array, check_call, check_eps, ffi_primitive, fold_batch_axis,
                              num_sms, on_gpu, warn_once)
from jax_cluster._sharding import row_partitioned
from jax_cluster.ops.attention_block_unfused import (attention_block_pallas, attention_block_split_k,
                                                     attention_block_xla, pallas_supported)
from jax_cluster.ops.decode_attention import kernel_error as decode_attention_kernel_error

__all__ = ["AttentionBlockConfig", "attention_block", "autotune", "candidates", "heuristic",
           "launch_plan", "tuning_key"]

KERNELS = ("fused", "split_k", "pallas")
DATAFLOWS = ("split_token", "split_head")
PIPELINES = ("registers", "tma")
NORMS = {None: "none", "rms": "rms", "layer": "layer"}
ROPE_LAYOUTS = ("half", "interleaved")
# A cache length XLA's attention matmuls take without padding (a copy of the V cache) first.
XLA_CACHE_ALIGN = 32
# Bump when the kernels, the candidates or how they are timed change: cached picks are
# re-measured.
KERNEL_VERSION = 17


@functools.cache
def _constants() -> dict:
    return dict(_extension.plans().attention_block_constants())


@dataclasses.dataclass(frozen=True)
class AttentionBlockConfig:
    """How attention_block runs on the GPU (impl="auto" or "cuda"). None: the default.

    kernel             "fused", "split_k" or "pallas" (module docstring).
    cluster_size       fused: blocks per cluster, 1-8 or 16 (3, 5, 6, 7: split_token only;
                       they let a grid fill the GPU in one wave where powers of two do not).
                       None: the smallest power of two whose grid covers the GPU
                       (split_head: the largest <= 4 that divides head_dim / 8).
    heads_per_cluster  fused: at most this many query heads per cluster (1..8): fewer heads
                       = more clusters per KV head (each re-reads that head's K/V columns
                       and cache), so GQA at small batch keeps more SMs busy. None: up to 8.
    dataflow           fused: "split_token" (a cluster's blocks share the tokens) or
                       "split_head" (they share the head dimension: ClusterFusion's
                       SplitHead, needs head_dim % (8 * cluster_size) == 0).
    pipeline           fused split_token: "registers" (every thread loads weights and KV
                       straight into registers) or "tma" (a producer warp streams every byte
                       through a TMA/mbarrier ring of shared-memory stages).
    splits             split_k: token splits per (row, KV head), 1..1024 (None: the
                       decode_attention default).
    """

    kernel: str = "fused"
    cluster_size: int | None = None
    heads_per_cluster: int | None = None
    dataflow: str = "split_token"
    pipeline: str = "registers"
    splits: int | None = None

    def __post_init__(self):
        def bad(message):
            raise ValueError(f"AttentionBlockConfig: {message}")

        if self.kernel not in KERNELS:
            bad(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.dataflow not in DATAFLOWS:
            bad(f"dataflow must be one of {DATAFLOWS}, got {self.dataflow!r}")
        if self.pipeline not in PIPELINES:
            bad(f"pipeline must be one of {PIPELINES}, got {self.pipeline!r}")
        for name in ("cluster_size", "heads_per_cluster", "splits"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise TypeError(f"AttentionBlockConfig: {name} must be an int or None, got {value!r}")
        fused_knobs = self.cluster_size is not None or self.heads_per_cluster is not None or (
            self.dataflow, self.pipeline) != ("split_token", "registers")
        if self.kernel != "fused" and fused_knobs:
            bad(f"cluster_size, heads_per_cluster, dataflow and pipeline are knobs of kernel='fused', "
                f"not {self.kernel!r}")
        if self.kernel != "split_k" and self.splits is not None:
            bad(f"splits is a knob of kernel='split_k', not {self.kernel!r}")
        sizes = _constants()["cluster_sizes"]
        if self.cluster_size is not None and self.cluster_size not in sizes:
            bad(f"cluster_size must be one of {sizes}, got {self.cluster_size}")
        max_heads = _constants()["max_heads_per_cluster"]
        if self.heads_per_cluster is not None and not 1 <= self.heads_per_cluster <= max_heads:
            bad(f"heads_per_cluster must be in 1..{max_heads}, got {self.heads_per_cluster}")
        if self.dataflow == "split_head" and self.pipeline != "registers":
            bad("pipeline='tma' is a split_token pipeline")
        if (self.dataflow == "split_head" and self.cluster_size is not None
                and self.cluster_size not in _constants()["pow2_cluster_sizes"]):
            bad(f"cluster_size={self.cluster_size} (not a power of two) is for dataflow='split_token' only")


# ----------------------------------------------------------------------------- launch plan
def _heads_per_cluster(group: int, max_heads: int | None = None) -> int:
    """Query heads per cluster: the group split into the fewest even chunks of <= max_heads
    (AttentionBlockParams::heads_per_cluster)."""
    max_heads = max_heads or _constants()["max_heads_per_cluster"]
    chunks = -(-group // max_heads)
    while group % chunks:
        chunks += 1
    return group // chunks


def default_cluster_size(batch: int, num_kv_heads: int, group: int, sms: int = 132,
                         heads_per_cluster: int | None = None) -> int:
    """The smallest power of two whose grid covers the GPU once."""
    clusters = batch * num_kv_heads * (group // _heads_per_cluster(group, heads_per_cluster))
    for n in _constants()["pow2_cluster_sizes"]:
        if clusters * n >= sms:
            return n
    return 16


def _resolved(config: AttentionBlockConfig, batch, num_kv_heads, group, head_dim) -> AttentionBlockConfig:
    """A fused config with every knob set (cluster_size filled in by the heuristic)."""
    if config.cluster_size is not None:
        return config
    if config.dataflow == "split_head":
        n = max([n for n in (1, 2, 4) if head_dim % (8 * n) == 0], default=1)
    else:
        n = default_cluster_size(batch, num_kv_heads, group, num_sms(), config.heads_per_cluster)
    return dataclasses.replace(config, cluster_size=n)


def launch_plan(config: AttentionBlockConfig, *, batch: int, hidden: int, head_dim: int,
                num_q_heads: int, num_kv_heads: int, rotary_dim: int, dtype) -> dict:
    """The fused kernel's launch for one call (cpp/ops/attention_block/plan.h): grid,
    threads, shared memory, TMA stages, workspace; 'error' / 'cuda_error' say why the step
    or the CUDA kernels cannot run it ('' when they can)."""
    c = _constants()
    config = _resolved(config, batch, num_kv_heads, num_q_heads // max(num_kv_heads, 1), head_dim)
    return dict(_extension.plans().attention_block(
        batch, hidden, head_dim, num_q_heads, num_kv_heads, rotary_dim, jnp.dtype(dtype).name,
        config.cluster_size, config.heads_per_cluster or c["max_heads_per_cluster"],
        c["dataflow"][config.dataflow], c["pipeline"][config.pipeline]))


# ----------------------------------------------------------------------------- primitive
# Operands that carry one row per batch element (x, lengths, k_cache, v_cache).
_PER_ROW = (0, 8, 9, 10)


def _abstract(x, norm_w, norm_b, w_qkv, qkv_bias, w_o, o_bias, inv_freq, lengths, k_cache,
              v_cache, *, num_q_heads, num_kv_heads, rotary_dim, cluster_size, max_heads_per_cluster,
              dataflow, pipeline, **_):
    plan = _extension.plans().attention_block(
        x.shape[0], x.shape[1], k_cache.shape[3], num_q_heads, num_kv_heads, rotary_dim,
        jnp.dtype(x.dtype).name, cluster_size, max_heads_per_cluster, dataflow, pipeline)
    return (ShapedArray(x.shape, x.dtype), ShapedArray(k_cache.shape, k_cache.dtype),
            ShapedArray(v_cache.shape, v_cache.dtype), ShapedArray((plan["workspace_bytes"],), np.uint8))


def _batching(args, dims, **params):
    """vmap: fold the mapped axis into the batch when only per-row operands are mapped
    (x, lengths, caches); otherwise map sequentially."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if all(d is None for i, d in enumerate(dims) if i not in _PER_ROW):
        moved = list(args)
        for i in _PER_ROW:
            a = fold_batch_axis(args[i], dims[i], size)
            moved[i] = a.reshape((size * a.shape[1],) + a.shape[2:])
        y, k, v, ws = _PRIM.bind(*moved, **params)
        unfold = lambda t: t.reshape((size, t.shape[0] // size) + t.shape[1:])  # noqa: E731
        return (unfold(y), unfold(k), unfold(v), ws), (0, 0, 0, None)
    moved = [jnp.moveaxis(a, d, 0) if d is not None else a for a, d in zip(args, dims)]

    def one(i):
        return _PRIM.bind(*[a[i] if d is not None else a for a, d in zip(moved, dims)], **params)[:3]

    y, k, v = jax.lax.map(one, jnp.arange(size))
    return (y, k, v, jnp.zeros((0,), np.uint8)), (0, 0, 0, None)


_PRIM = ffi_primitive("attention_block", abstract_eval=_abstract, batching_rule=_batching,
                      operand_output_aliases={9: 1, 10: 2})


def _bind_fused(config: AttentionBlockConfig, x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *,
                num_q_heads, num_kv_heads, norm, norm_weight, norm_bias, eps, qkv_bias, o_bias,
                residual, rotary_dim, rope_layout, scale):
    c = _constants()
    empty = jnp.zeros((0,), x.dtype)
    y, k, v, _ = _PRIM.bind(
        x, empty if norm_weight is None else norm_weight, empty if norm_bias is None else norm_bias,
        w_qkv, empty if qkv_bias is None else qkv_bias, w_o, empty if o_bias is None else o_bias,
        inv_freq, lengths, k_cache, v_cache,
        num_q_heads=int(num_q_heads), num_kv_heads=int(num_kv_heads), rotary_dim=int(rotary_dim),
        rope_layout=c["rope_layout"][rope_layout], norm=c["norm"][NORMS[norm]], eps=np.float32(eps),
        scale=np.float32(scale), residual=bool(residual), has_qkv_bias=qkv_bias is not None,
        has_o_bias=o_bias is not None, cluster_size=int(config.cluster_size),
        max_heads_per_cluster=int(config.heads_per_cluster or c["max_heads_per_cluster"]),
        dataflow=c["dataflow"][config.dataflow], pipeline=c["pipeline"][config.pipeline])
    return y, k, v


# ----------------------------------------------------------------------------- public op
def _validate(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *, num_q_heads, num_kv_heads,
              norm, norm_weight, norm_bias, qkv_bias, o_bias, rotary_dim, rope_layout):
    op = "attention_block"
    if x.ndim != 2:
        raise ValueError(f"{op}: x must be [B, D], got shape {tuple(x.shape)}")
    if k_cache.ndim != 4:
        raise ValueError(f"{op}: k_cache must be [B, Hkv, S_max, Dh], got shape {tuple(k_cache.shape)}")
    batch, hidden = x.shape
    _, _, max_seq, head_dim = k_cache.shape
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{op}: num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    dt = jnp.dtype(x.dtype)
    if dt not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"{op}: x dtype must be float16, bfloat16 or float32, got {dt.name}")
    if rotary_dim % 2 or not 0 <= rotary_dim <= head_dim:
        raise ValueError(f"{op}: rotary_dim ({rotary_dim}) must be even and <= head_dim ({head_dim})")
    if norm not in NORMS:
        raise ValueError(f"{op}: norm must be one of {list(NORMS)}, got {norm!r}")
    if rope_layout not in ROPE_LAYOUTS:
        raise ValueError(f"{op}: rope_layout must be 'half' or 'interleaved', got {rope_layout!r}")
    cols = (num_q_heads + 2 * num_kv_heads) * head_dim
    check_array(op, "k_cache", k_cache, (batch, num_kv_heads, max_seq, head_dim), dt)
    check_array(op, "v_cache", v_cache, k_cache.shape, dt)
    check_array(op, "w_qkv", w_qkv, (hidden, cols), dt)
    check_array(op, "w_o", w_o, (num_q_heads * head_dim, hidden), dt)
    check_array(op, "qkv_bias", qkv_bias, (cols,), dt)
    check_array(op, "o_bias", o_bias, (hidden,), dt)
    check_array(op, "lengths", lengths, (batch,), jnp.int32)
    check_array(op, "inv_freq", inv_freq, (rotary_dim // 2,), jnp.float32)
    if norm is not None:
        if norm_weight is None:
            raise ValueError(f"{op}: norm={norm!r} needs norm_weight")
        check_array(op, "norm_weight", norm_weight, (hidden,), dt)
    if norm == "layer":
        if norm_bias is None:
            raise ValueError(f"{op}: norm='layer' needs norm_bias")
        check_array(op, "norm_bias", norm_bias, (hidden,), dt)
    if not isinstance(lengths, jax.core.Tracer):
        lens = np.asarray(lengths)
        if lens.size and (lens.min() < 0 or lens.max() >= max_seq):
            raise ValueError(f"{op}: lengths must be in [0, S_max={max_seq}) (the new token is written "
                             f"at lengths[b]); got min {lens.min()}, max {lens.max()}")


def attention_block(
    x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *,
    num_q_heads: int, num_kv_heads: int,
    norm: str | None = "rms", norm_weight=None, norm_bias=None, eps: float = 1e-6,
    qkv_bias=None, o_bias=None, residual: bool = False,
    rotary_dim: int | None = None, rope_layout: str = "half", scale: float | None = None,
    impl: str = "auto", config: AttentionBlockConfig | None = None,
):
    """One decode step of an attention block; returns (y [B, D], k_cache, v_cache).

    x [B, D]; w_qkv [D, (Hq + 2 Hkv) Dh] (columns [Q heads | K heads | V heads]);
    w_o [Hq Dh, D]; caches [B, Hkv, S_max, Dh]; lengths int32 [B] (tokens already cached:
    the new token goes to slot lengths[b]); inv_freq float32 [rotary_dim // 2].
    norm: "rms", "layer" (needs norm_bias) or None. scale: None = 1/sqrt(Dh).
    impl: "auto", "cuda", "xla" or "reference" (module docstring). config: an
    AttentionBlockConfig run exactly (impl "auto" or "cuda"); None: the tuner's pick for
    impl="auto", the heuristic fused configuration for impl="cuda".
    On a GPU the fused kernel takes head_dim 64/80/96/128/256, D % 64 == 0, float16/bfloat16;
    where it does not, split_k (decode_attention's kernels: any D) is what impl="cuda" runs and
    what "auto" weighs against XLA.
    """
    check_call("attention_block", impl, config, AttentionBlockConfig)
    head_dim = k_cache.shape[-1] if k_cache.ndim == 4 else 0
    rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
    _validate(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, num_q_heads=num_q_heads,
              num_kv_heads=num_kv_heads, norm=norm, norm_weight=norm_weight, norm_bias=norm_bias,
              qkv_bias=qkv_bias, o_bias=o_bias, rotary_dim=rotary_dim, rope_layout=rope_layout)
    if norm is not None:
        check_eps("attention_block", "eps", eps)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"attention_block: scale must be finite, got {scale}")
    if x.shape[0] == 0:  # no rows: nothing to launch (a grid of no blocks is a launch error)
        return jnp.zeros(x.shape, x.dtype), k_cache, v_cache
    args = (x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq)
    kwargs = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, norm=norm,
                  norm_weight=norm_weight, norm_bias=norm_bias, eps=eps, qkv_bias=qkv_bias,
                  o_bias=o_bias, residual=residual, rotary_dim=rotary_dim,
                  rope_layout=rope_layout, scale=scale)
    if impl == "reference":
        return reference.attention_block(*args, **kwargs)
    if impl == "xla":
        return attention_block_xla(*args, **kwargs)

    batch, hidden = x.shape
    hkv, max_seq = k_cache.shape[1], k_cache.shape[2]
    shape = dict(batch=batch, hidden=hidden, head_dim=head_dim, num_q_heads=num_q_heads,
                 num_kv_heads=num_kv_heads, rotary_dim=rotary_dim, dtype=x.dtype)
    default, why_not = _default_config(shape)
    if impl == "auto" and default is None:
        warn_once(("attention_block", head_dim, hidden, jnp.dtype(x.dtype).name),
                  f"attention_block: {why_not}; using XLA's ops (impl='xla')")
        return attention_block_xla(*args, **kwargs)
    if config is None:
        config = (_pick(batch, hidden, num_q_heads, hkv, max_seq, head_dim, x.dtype) if impl == "auto"
                  else default or heuristic())
        if config == "xla":
            return attention_block_xla(*args, **kwargs)
    return _run_rows(config, args, kwargs, shape)


def _default_config(shape) -> tuple[AttentionBlockConfig | None, str]:
    """(what runs the call untuned, why the fused kernel cannot): heuristic() where the fused
    kernel takes the shape (always on CPU, whose handler takes any), else split_k where
    decode_attention's kernels take it (D % 64 != 0), else None."""
    if not on_gpu():
        return heuristic(), ""
    why_not = _cuda_error(AttentionBlockConfig(), **shape)
    if not why_not:
        return heuristic(), ""
    if not _split_k_error(**shape):
        return AttentionBlockConfig(kernel="split_k"), why_not
    return None, why_not


def _split_k_error(*, head_dim, num_q_heads, num_kv_heads, rotary_dim, dtype, **_) -> str:
    """Why split_k's attention (decode_attention_append's kernels) cannot run the shape, or ''."""
    return decode_attention_kernel_error(group=num_q_heads // num_kv_heads, head_dim=head_dim,
                                         dtype=dtype, rotary_dim=rotary_dim, append=True)


_ARRAY_KWARGS = ("norm_weight", "norm_bias", "qkv_bias", "o_bias")


def _run_rows(config: AttentionBlockConfig, args, kwargs, shape):
    """_run, on each device's rows where the rows are sharded over a mesh (jax_cluster._sharding):
    every kernel form (fused, split_k, Pallas) sees its own device's batch."""
    static = {k: v for k, v in kwargs.items() if k not in _ARRAY_KWARGS}
    extra = {k: kwargs[k] for k in _ARRAY_KWARGS if kwargs[k] is not None}

    def run(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, extra):
        return _run(config, (x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq),
                    {**static, **dict.fromkeys(_ARRAY_KWARGS), **extra}, {**shape, "batch": x.shape[0]})

    rows = (True, False, False, True, True, True, False, False)
    return row_partitioned(run, rows, (True, True, True))(*args, extra)


def _cuda_error(config: AttentionBlockConfig, **shape) -> str:
    plan = launch_plan(config, **shape)
    return plan["error"] or plan["cuda_error"]


def _run(config: AttentionBlockConfig, args, kwargs, shape):
    if config.kernel == "split_k":
        return attention_block_split_k(*args, splits=config.splits, **kwargs)
    if config.kernel == "pallas":
        if not on_gpu():
            raise ValueError("attention_block: kernel='pallas' runs Pallas' GPU kernel; the backend is "
                             f"{jax.default_backend()!r}")
        return attention_block_pallas(*args, **kwargs)
    x, k_cache = args[0], args[3]
    config = _resolved(config, x.shape[0], shape["num_kv_heads"],
                       shape["num_q_heads"] // shape["num_kv_heads"], k_cache.shape[-1])
    plan = launch_plan(config, **shape)
    why_not = plan["error"] or (plan["cuda_error"] if on_gpu() else "")
    if why_not:
        raise ValueError(f"attention_block: {why_not} ({config})")
    return _bind_fused(config, *args, **kwargs)


# ----------------------------------------------------------------------------- tuning
def heuristic() -> AttentionBlockConfig:
    """The choice when tuning is off (JAX_CLUSTER_TUNING=0), on CPU, or for impl="cuda"
    without a config: the fused kernel at the cluster size that covers the GPU once."""
    return AttentionBlockConfig()


def _one_wave_size(clusters: int, sms: int) -> int | None:
    """The largest cluster size that is not a power of two (3, 5, 6, 7) whose grid of
    `clusters` clusters needs at most one block per SM, or None."""
    fits = [n for n in _constants()["cluster_sizes"] if n & (n - 1) and clusters * n <= sms]
    return max(fits) if fits else None


def candidates(*, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_seq: int,
               sms: int = 132) -> list:
    """What the tuner measures for one shape: the fused kernel at power-of-two cluster sizes
    and at the one-wave size that is not a power of two; for GQA fewer heads per cluster
    (more clusters per KV head) at clusters of 2, 4, 8; the TMA pipeline at the sizes that
    fill an H100 at small batch; split_k (G <= 8), Pallas (where it takes the shape) and
    XLA's ops, so "auto" is never slower than plain XLA where the fused kernel loses."""
    group = num_q_heads // num_kv_heads
    fused = AttentionBlockConfig
    default = _heads_per_cluster(group)
    fewer = sorted({_heads_per_cluster(group, h) for h in (1, 2, 4) if h < default}, reverse=True)[:2]
    out = [fused(cluster_size=n) for n in _constants()["pow2_cluster_sizes"]]
    spread = [fused(cluster_size=n, heads_per_cluster=h) for h in fewer for n in (2, 4, 8)]
    odd = []
    for h in [None] + fewer:
        n = _one_wave_size(batch * num_kv_heads * (group // _heads_per_cluster(group, h)), sms)
        if n is not None:
            odd.append(fused(cluster_size=n, heads_per_cluster=h))
    tma = [dataclasses.replace(c, pipeline="tma")
           for c in [fused(cluster_size=n) for n in (2, 4, 8)] + odd + spread if c.cluster_size != 2
           or c.heads_per_cluster is None]
    out += odd + spread + tma
    if group <= int(_extension.plans().decode_attention_constants()["max_group"]):
        out.append(AttentionBlockConfig(kernel="split_k"))
    if pallas_supported(head_dim, max_seq):
        out.append(AttentionBlockConfig(kernel="pallas"))
    return out + ["xla"]


def timed_context(max_seq: int) -> tuple[int, bool]:
    """(the S_max a tuner times for this cache, whether S_max is unaligned for XLA): context
    is bucketed by `tuning.context_bucket`; XLA pads a cache whose length is not a multiple
    of 32 (a copy of it every step), so such a length is a key of its own, timed 16 short
    of the bucket. decoder_layer's tuner times its per-op path the same way."""
    bucket = tuning.context_bucket(max_seq)
    unaligned = max_seq % XLA_CACHE_ALIGN != 0
    return (bucket - 16 if unaligned and bucket > 32 else bucket), unaligned


def tuning_key(batch, hidden, num_q_heads, num_kv_heads, max_seq, head_dim, dtype) -> str:
    _, unaligned = timed_context(max_seq)
    return tuning.make_key(KERNEL_VERSION, b=batch, d=hidden, hq=num_q_heads, hkv=num_kv_heads,
                           dh=head_dim, ctx=tuning.context_bucket(max_seq),
                           dtype=jnp.dtype(dtype).name,
                           pallas=int(pallas_supported(head_dim, max_seq)), unaligned=int(unaligned))


def measure(choice, *, batch, hidden, num_q_heads, num_kv_heads, max_seq, head_dim, dtype,
            steps: int = 10) -> float:
    """Seconds per decode step of `choice` ("xla" or an AttentionBlockConfig): `steps`
    steps written out in one jitted program (not a fori_loop: the loop's own kernels cost
    custom calls more per step than XLA's ops), caches carried and donated as in a decode
    loop, weights passed as arguments (captured as constants they are baked into every
    candidate's program and make compiles slow)."""
    hq, hkv = num_q_heads, num_kv_heads
    ctx, _ = timed_context(max_seq)
    keys = iter(jax.random.split(jax.random.key(0), 8))
    # drawn on the device and in the caches' dtype: an fp32 draw of a batch-64, 128K-slot
    # cache would not fit
    f = lambda *s, sc=1.0: jax.random.normal(next(keys), s, dtype) * jnp.asarray(sc, dtype)  # noqa: E731
    kc, vc = f(batch, hkv, ctx, head_dim), f(batch, hkv, ctx, head_dim)
    consts = (f(hidden, (hq + 2 * hkv) * head_dim, sc=hidden ** -0.5), f(hq * head_dim, hidden, sc=0.02),
              jnp.full((batch,), ctx - 1, jnp.int32), jnp.ones((head_dim // 2,), jnp.float32), f(hidden))
    run = dict(impl="xla") if choice == "xla" else dict(impl="cuda", config=choice)

    @functools.partial(jax.jit, donate_argnums=0)
    def loop(state, consts):
        w_qkv, w_o, lengths, inv_freq, nw = consts
        for _ in range(steps):
            state = attention_block(state[0], w_qkv, w_o, state[1], state[2], lengths, inv_freq,
                                    num_q_heads=hq, num_kv_heads=hkv, norm_weight=nw, residual=True,
                                    **run)
        return state

    return tuning.time_carried(lambda state: loop(state, consts), (f(batch, hidden), kc, vc)) / steps


def _pick(batch, hidden, num_q_heads, num_kv_heads, max_seq, head_dim, dtype):
    plan_shape = dict(batch=batch, hidden=hidden, head_dim=head_dim, num_q_heads=num_q_heads,
                      num_kv_heads=num_kv_heads, rotary_dim=head_dim, dtype=dtype)
    fallback, _ = _default_config(plan_shape)
    if not on_gpu():
        return fallback  # nothing to tune: the CPU handler computes the same math
    fallback = fallback or "xla"
    shape = dict(batch=batch, hidden=hidden, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                 max_seq=max_seq, head_dim=head_dim, dtype=jnp.dtype(dtype))
    split_k_ok = not _split_k_error(**plan_shape)
    cands = [c for c in candidates(batch=batch, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, max_seq=max_seq, sms=num_sms())
             if c == "xla" or (c.kernel == "split_k" and split_k_ok) or c.kernel == "pallas"
             or (c.kernel == "fused" and not _cuda_error(c, **plan_shape))]
    return tuning.pick("attention_block", tuning_key(**shape), cands,
                       functools.partial(measure, **shape), heuristic=fallback)


def autotune(batch: int, hidden: int, num_q_heads: int, num_kv_heads: int, max_seq: int,
             head_dim: int, dtype):
    """Runs the tuner now for one shape (e.g. at deployment warm-up); returns what
    impl="auto" will run for it: an AttentionBlockConfig or "xla"."""
    return _pick(batch, hidden, num_q_heads, num_kv_heads, max_seq, head_dim, jnp.dtype(dtype))
