"""attention_decode: one fused decode step of a Llama-family attention block.

    h      = norm(x[b])                        (RMSNorm / LayerNorm / none)
    q,k,v  = h @ w_qkv (+ qkv_bias)            columns [Q heads | K heads | V heads]
    q, k   = rope(q, k, position=lengths[b])   inv_freq given, rotary_dim <= head_dim
    caches[b, :, lengths[b]] = k, v            in place (the caches are aliased outputs)
    o_h    = softmax(scale * q_h . K[:len+1]) V[:len+1]   (GQA: kv head = h // (Hq/Hkv))
    y[b]   = concat(o) @ w_o (+ o_bias) (+ x[b] if residual)

On a Hopper GPU this is ONE cluster kernel (ClusterFusion Alg. 3) plus a tiny
deterministic combine; shapes it does not cover run XLA's ops (impl="xla") with a
one-time warning, and the tuner picks "xla" (XLA's ops), "pallas" (Pallas' decode
attention between XLA's matmuls) or "splitk" (our split-K decode attention kernel,
jax_cluster.ops.decode_attention, between XLA's matmuls) where it measures one faster
than the fused kernel.
Donate the caches (jax.jit(..., donate_argnums=...)) so the update happens in place.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster import reference
from jax_cluster._ffi import ffi_primitive
from jax_cluster.ops.attention_decode_xla import (attention_decode_pallas, attention_decode_splitk,
                                                  attention_decode_xla, pallas_supported)
from jax_cluster.ops.decode_attention import MAX_GROUP as SPLITK_MAX_GROUP

NORMS = {None: 0, "rms": 1, "layer": 2}
ROPE_LAYOUTS = {"half": 0, "interleaved": 1}
# Cluster sizes of the SplitToken kernels. 3, 5, 6, 7 (collectives without a butterfly)
# let a grid fit the GPU in one wave where powers of two do not: an H100 keeps 31
# clusters of 4 resident (GPCs hold whole clusters), so 32 clusters of 4 run some SMs
# twice; 32 clusters of 3 all fit. Measured (session 11, Llama-2-7B b1): as fast as 4 at
# ctx4K, 4% faster at ctx16K; the tuner decides. SplitHead and the batch-tiled kernel take
# powers of two.
CLUSTER_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16)
POW2_CLUSTER_SIZES = (1, 2, 4, 8, 16)
IMPLS = ("auto", "kernel", "xla", "pallas", "splitk", "reference")
# Tuner choices that run no fused kernel: XLA's projections around an attention of XLA
# (einsums), Pallas or our split-K kernel.
UNFUSED = ("xla", "pallas", "splitk")
DATAFLOWS = {"split_token": 0, "split_head": 1}  # AttnDataflow in cpp/kernels/attention_decode.h
# How SplitToken streams weights and KV (AttnPipeline): "registers" = every thread loads
# straight into registers; "tma" = a producer warp feeds a ring of shared-memory stages
# through the bulk copy engine (TMA/mbarrier), 7 consumer warps compute.
PIPELINES = {"registers": 0, "tma": 1}
CUDA_HEAD_DIMS = (64, 80, 96, 128)
MAX_HEADS_PER_CLUSTER = 8
# Batch rows per cluster: R > 1 runs the batch-tiled register kernel (one cluster per KV
# head, head chunk and tile of R rows: the weights are read once per tile, not per row).
ROWS_PER_CLUSTER = (1, 2, 4, 8, 16)
# A cache length XLA's attention matmuls take without padding (a copy of the V cache) first.
XLA_CACHE_ALIGN = 32
SHARED_BYTES_PER_BLOCK = 232448 - 2048  # a Hopper block's opt-in shared memory, less static (<= 1.4 KB)


def _heads_per_cluster(group: int, max_heads: int = MAX_HEADS_PER_CLUSTER) -> int:
    """Query heads per cluster: the group split into the fewest even chunks of <= max_heads
    (mirrors AttentionDecodeParams::head_chunks)."""
    chunks = -(-group // max_heads)
    while group % chunks:
        chunks += 1
    return group // chunks


def _tiled_shared_bytes(hidden: int, rows: int, heads_per_cluster: int, head_dim: int,
                        cluster_size: int) -> int:
    """Dynamic shared memory of the batch-tiled kernel per block (mirrors TiledLayout in
    cpp/kernels/attention_decode.h)."""
    up = lambda b: (b + 127) // 128 * 128  # noqa: E731
    hpc, dh = heads_per_cluster, head_dim
    vecs_per_block = -(-((hpc + 2) * dh // 8) // cluster_size)
    after_h = (up(4 * rows * hpc * (dh + 4)) + up(4 * 8 * MAX_HEADS_PER_CLUSTER * (dh + 2))
               + up(4 * hpc * dh * rows) + up(4 * rows * hpc * 17))
    h_value_bytes = 2 if rows >= 16 or (rows == 8 and hpc <= 2 and dh % 64 == 0) else 4
    h = up(hidden * rows * h_value_bytes)
    return (max(after_h, h) + up(4 * rows * vecs_per_block * 8)
            + up(max(4 * rows * (hpc + 2) * dh, 4 * 2 * 256 * 8)))


def _check_tiled_fits(hidden, rows, heads_per_cluster, head_dim, cluster_size):
    need = _tiled_shared_bytes(hidden, rows, heads_per_cluster, head_dim, cluster_size)
    if need > SHARED_BYTES_PER_BLOCK:
        raise ValueError(
            f"attention_decode: rows_per_cluster={rows} needs {need} bytes of shared memory per block "
            f"(hidden={hidden}, {heads_per_cluster} query heads per cluster, head_dim={head_dim}, "
            f"cluster_size={cluster_size}), more than the {SHARED_BYTES_PER_BLOCK} a block has; use "
            "fewer rows per cluster (or fewer heads per cluster)")


def _workspace_bytes(batch, hidden, num_q_heads, num_kv_heads, max_heads=MAX_HEADS_PER_CLUSTER):
    group = num_q_heads // num_kv_heads
    chunks = group // _heads_per_cluster(group, max_heads)
    return batch * num_kv_heads * chunks * hidden * 4


def _abstract(x, norm_w, norm_b, w_qkv, qkv_bias, w_o, o_bias, inv_freq, lengths, k_cache,
              v_cache, *, num_q_heads, num_kv_heads, max_heads_per_cluster, **_):
    ws = _workspace_bytes(x.shape[0], x.shape[1], num_q_heads, num_kv_heads, max_heads_per_cluster)
    return (ShapedArray(x.shape, x.dtype), ShapedArray(k_cache.shape, k_cache.dtype),
            ShapedArray(v_cache.shape, v_cache.dtype), ShapedArray((ws,), np.uint8))


def _batching(args, dims, **params):
    """vmap: fold the mapped axis into the batch when only per-row operands are
    mapped (x, lengths, caches); otherwise map sequentially."""
    per_row = {0, 8, 9, 10}
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    if all(d is None for i, d in enumerate(dims) if i not in per_row):
        moved = []
        for i, (a, d) in enumerate(zip(args, dims)):
            if i in per_row:
                a = jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
                a = a.reshape((size * a.shape[1],) + a.shape[2:])
            moved.append(a)
        y, k, v, ws = _PRIM.bind(*moved, **params)
        unfold = lambda t: t.reshape((size, t.shape[0] // size) + t.shape[1:])  # noqa: E731
        return (unfold(y), unfold(k), unfold(v), ws), (0, 0, 0, None)
    moved = [jnp.moveaxis(a, d, 0) if d is not None else a for a, d in zip(args, dims)]

    def one(i):
        return _PRIM.bind(*[a[i] if d is not None else a for a, d in zip(moved, dims)], **params)[:3]

    y, k, v = jax.lax.map(one, jnp.arange(size))
    return (y, k, v, jnp.zeros((0,), np.uint8)), (0, 0, 0, None)


_PRIM = ffi_primitive(
    "attention_decode",
    abstract_eval=_abstract,
    batching_rule=_batching,
    operand_output_aliases={9: 1, 10: 2},
)

_warned: set = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def _check(name, array, shape, dtype=None):
    if array is None:
        return
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"attention_decode: {name} has shape {tuple(array.shape)}, expected {tuple(shape)}")
    if dtype is not None and jnp.dtype(array.dtype) != jnp.dtype(dtype):
        raise ValueError(f"attention_decode: {name} has dtype {array.dtype}, expected {jnp.dtype(dtype)}")


def default_cluster_size(batch: int, num_kv_heads: int, group: int, num_sms: int = 132) -> int:
    """Heuristic: the smallest power of two whose grid covers the GPU once."""
    clusters = batch * num_kv_heads * (group // _heads_per_cluster(group))
    for n in POW2_CLUSTER_SIZES:
        if clusters * n >= num_sms:
            return n
    return 16


def _one_wave_size(clusters: int, num_sms: int) -> int | None:
    """The largest cluster size that is not a power of two (3, 5, 6, 7) whose grid of
    `clusters` clusters needs at most one block per SM, or None."""
    fits = [n for n in CLUSTER_SIZES if n & (n - 1) and clusters * n <= num_sms]
    return max(fits) if fits else None


def _tuner_candidates(group: int, batch: int = 1, num_kv_heads: int = 1, hidden: int | None = None,
                      head_dim: int | None = None, num_sms: int = 132) -> tuple:
    """Cluster sizes (default heads per cluster), "xla", "pallas", and for GQA fewer heads per
    cluster ("n8:h2": cluster 8, <= 2 query heads each): more clusters per KV head; each
    cluster configuration with the register pipeline, and the TMA pipeline ("tma:" prefix)
    at the sizes that fill an H100 at small batch (2, 4, 8). Per heads-per-cluster choice
    also the one-wave size that is not a power of two (_one_wave_size: 32 clusters -> 3).
    For batch > 1 also the batch-tiled kernel (_tiled_candidates)."""
    default = _heads_per_cluster(group)
    fewer = sorted({_heads_per_cluster(group, h) for h in (1, 2, 4) if h < default}, reverse=True)
    spread = tuple(f"n{n}:h{h}" for h in fewer[:2] for n in (2, 4, 8))
    odd = []
    for h in (default,) + tuple(fewer[:2]):
        n = _one_wave_size(batch * num_kv_heads * (group // h), num_sms)
        if n is not None:
            odd.append(n if h == default else f"n{n}:h{h}")
    tma = tuple(f"tma:{c}" for c in (2, 4, 8) + tuple(odd)
                + tuple(c for c in spread if not c.startswith("n2")))
    tiled = _tiled_candidates(group, batch, num_kv_heads, hidden, head_dim, num_sms)
    splitk = ("splitk",) if group <= SPLITK_MAX_GROUP else ()
    return POW2_CLUSTER_SIZES + ("xla", "pallas") + splitk + tuple(odd) + spread + tma + tiled


def _tiled_candidates(group, batch, num_kv_heads, hidden, head_dim, num_sms=132) -> tuple:
    """Batch-tiled choices "n<size>:r<rows>" for batch > 1: per tile size R (up to the
    first that covers the batch), the cluster sizes whose grid holds 0.5 to 2 blocks per SM
    (the kernels run one or two blocks per SM, kTiledMinBlocks: fewer blocks leave SMs idle,
    more run in waves), or else the one closest to one per SM; only those whose shared
    memory fits. Measured (session 8, H100, b16 ctx4096): Llama-2-7B n2:r4, Llama-3-8B n2:r2."""
    if batch <= 1:
        return ()
    hpc = _heads_per_cluster(group)
    out = []
    for rows in ROWS_PER_CLUSTER[1:]:
        if rows // 2 >= batch:
            break
        fits = [n for n in POW2_CLUSTER_SIZES if hidden is None or _tiled_shared_bytes(
            hidden, rows, hpc, head_dim, n) <= SHARED_BYTES_PER_BLOCK]
        blocks = {n: -(-batch // rows) * num_kv_heads * (group // hpc) * n for n in fits}
        chosen = [n for n in fits if num_sms / 2 <= blocks[n] <= 2 * num_sms]
        if not chosen and fits:
            chosen = [min(fits, key=lambda n: abs(math.log(blocks[n] / num_sms)))]
        out += [f"n{n}:r{rows}" for n in chosen]
    return tuple(out)


def parse_choice(choice) -> tuple[int, int | None, str, int] | str:
    """A tuner choice -> (cluster_size, max heads per cluster or None, pipeline, rows per
    cluster), or "xla" / "pallas" / "splitk" (no fused kernel). Choices: a cluster size (4),
    "n8:h2" (cluster 8, <= 2 query heads per cluster), "n4:r8" (cluster 4, tiles of 8 batch
    rows), a "tma:" prefix (the TMA pipeline)."""
    if choice in UNFUSED:
        return choice
    pipeline = "registers"
    if isinstance(choice, str) and choice.startswith("tma:"):
        pipeline, choice = "tma", choice[4:]
    if isinstance(choice, str) and choice.startswith("n"):
        fields = {f[0]: int(f[1:]) for f in choice.split(":")}
        return fields["n"], fields.get("h"), pipeline, fields.get("r", 1)
    return int(choice), None, pipeline, 1


KERNEL_VERSION = 16  # bump when the kernels (or how they are timed) change: cached choices are re-measured


def _choose_cluster_size(on_gpu, batch, hidden, hq, hkv, max_seq, head_dim, dtype) -> int | str:
    """The tuner's pick on a GPU (measured once per shape, cached on disk; see
    jax_cluster.tuning), else the heuristic. Context is bucketed to a power of two, and a
    cache length that is not a multiple of XLA_CACHE_ALIGN is a key of its own.
    Candidates: the kernel's configurations, "xla" (XLA's own ops, attention_decode_xla),
    "splitk" (attention_decode_splitk) and "pallas" (attention_decode_pallas) where Pallas
    takes this S_max (then it also takes the
    bucket it is timed at); an S_max it does not take is a key of its own ("nopallas"), so
    those shapes get the best of the other candidates."""
    sms = getattr(jax.devices()[0], "core_count", 132) if on_gpu else 132
    heuristic = default_cluster_size(batch, hkv, hq // hkv, sms)
    if not on_gpu:
        return heuristic
    from jax_cluster import tuning

    bucket = 1 << max(0, (max_seq - 1).bit_length())
    with_pallas = pallas_supported(head_dim, max_seq)
    # XLA pads a cache whose length is not a multiple of 32 (a copy of it every step: 1.7x
    # the step at Llama-3-8B b16 4K, H100): such a length is timed as one, 16 short of the bucket
    unaligned = max_seq % XLA_CACHE_ALIGN != 0
    ctx = bucket - 16 if unaligned and bucket > 32 else bucket
    key = (f"v{KERNEL_VERSION} {tuning.device_name()} b{batch} d{hidden} hq{hq} hkv{hkv} dh{head_dim} "
           f"ctx{bucket} {jnp.dtype(dtype).name}" + ("" if with_pallas else " nopallas")
           + (" unaligned" if unaligned else ""))

    def measure(choice):
        parsed = parse_choice(choice)
        n, heads, pipeline, rows = (None, None, None, 1) if isinstance(parsed, str) else parsed
        # drawn on the device (numpy took seconds per candidate for a batch-16 cache) and in
        # the caches' dtype: an fp32 draw of a batch-64, 128K-slot cache would be 34 GB
        keys = iter(jax.random.split(jax.random.key(0), 8))
        f = lambda *s, sc=1.0: jax.random.normal(next(keys), s, dtype) * jnp.asarray(sc, dtype)  # noqa: E731
        kc, vc = f(batch, hkv, ctx, head_dim), f(batch, hkv, ctx, head_dim)
        consts = (f(hidden, (hq + 2 * hkv) * head_dim, sc=hidden ** -0.5),
                  f(hq * head_dim, hidden, sc=0.02), jnp.full((batch,), ctx - 1, jnp.int32),
                  jnp.ones((head_dim // 2,), jnp.float32), f(hidden))

        # caches carried and donated: in place, as in a decode loop (a fresh copy of them per
        # call would add the same time to every candidate and blur their differences); the
        # weights are arguments, not constants captured by the trace (baked into every
        # candidate's program, 100+ MB of them made each compile take seconds)
        @functools.partial(jax.jit, donate_argnums=0)
        def loop(state, consts):
            w_qkv, w_o, lengths, inv_freq, nw = consts

            def body(i, s):
                return attention_decode(s[0], w_qkv, w_o, s[1], s[2], lengths, inv_freq,
                                        num_q_heads=hq, num_kv_heads=hkv, norm_weight=nw,
                                        residual=True, cluster_size=n, heads_per_cluster=heads,
                                        pipeline=pipeline, rows_per_cluster=rows,
                                        impl=parsed if isinstance(parsed, str) else "kernel")

            # written out, not a fori_loop: the loop's own kernels cost custom calls ~2 us
            # more per step than XLA's ops (H100, benchmarks/results/logs/session18)
            for i in range(10):
                state = body(i, state)
            return state

        return tuning.time_carried(lambda state: loop(state, consts), (f(batch, hidden), kc, vc)) / 10

    candidates = [c for c in _tuner_candidates(hq // hkv, batch, hkv, hidden, head_dim, sms)
                  if c != "pallas" or with_pallas]
    return tuning.pick("attention_decode", key, candidates, measure, heuristic=heuristic)


def autotune(batch: int, hidden: int, num_q_heads: int, num_kv_heads: int, max_seq: int,
             head_dim: int, dtype) -> int | str:
    """Runs the tuner now for one shape (e.g. at deployment warm-up); returns what
    impl="auto" will run for it: a cluster size of the kernel, "n<size>:h<heads>" (cluster
    size and at most that many query heads per cluster), either with a "tma:" prefix (the
    TMA pipeline), "n<size>:r<rows>" (the batch-tiled kernel), "xla", "pallas" or "splitk"."""
    return _choose_cluster_size(jax.default_backend() == "gpu", batch, hidden, num_q_heads,
                                num_kv_heads, max_seq, head_dim, dtype)


def attention_decode(
    x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, *,
    num_q_heads: int, num_kv_heads: int,
    norm: str | None = "rms", norm_weight=None, norm_bias=None, eps: float = 1e-6,
    qkv_bias=None, o_bias=None, residual: bool = False,
    rotary_dim: int | None = None, rope_layout: str = "half", scale: float | None = None,
    cluster_size: int | None = None, heads_per_cluster: int | None = None, impl: str = "auto",
    dataflow: str = "split_token", pipeline: str | None = None, rows_per_cluster: int | None = None,
):
    """One fused decode step; returns (y [B, D], k_cache, v_cache).

    cluster_size None: on a GPU the tuner measures 1, 2, 4, 8, 16 (and the size of 3, 5, 6, 7
    whose grid fits one block per SM) once per shape
    (outside any trace; cached in the tuning file, JAX_CLUSTER_TUNING=0 for the
    heuristic); an explicit size overrides. heads_per_cluster: at most this many query
    heads per cluster (1..8; None: up to 8, or the tuner's pick), so a GQA group can be
    spread over several clusters at small batch. dataflow: how a cluster's blocks share the
    attention: "split_token" (by tokens; the tuned default) or "split_head" (by head
    dimension, ClusterFusion's SplitHead alternative: the scores of every token are reduced
    across the cluster; needs head_dim % (8 * cluster_size) == 0; cluster_size None picks
    the largest such size <= 4, untuned). pipeline (SplitToken): "registers" (weights and
    KV loaded straight into registers by every thread) or "tma" (a producer warp streams
    every byte through a TMA/mbarrier ring of shared-memory stages); None: the tuner's pick
    when it picks the cluster size, else "registers". rows_per_cluster (1, 2, 4, 8, 16): batch
    rows per cluster; R > 1 runs the batch-tiled register kernel (one cluster per KV head, head
    chunk and tile of R rows: each weight byte is read once per tile and used for R rows;
    split_token with pipeline "registers" only); None: the tuner's pick when it picks the
    cluster size, else 1.

    x [B, D]; w_qkv [D, (Hq + 2 Hkv) Dh]; w_o [Hq Dh, D]; caches [B, Hkv, S_max, Dh];
    lengths int32 [B] (tokens already cached); inv_freq float32 [rotary_dim // 2].
    impl: "auto" (on a GPU the tuner's pick among the kernel's configurations, "xla" and
    "pallas"; shapes without a kernel run "xla" with a one-time warning), "kernel" (the FFI
    op; an error where unsupported; where the tuner picked "xla" or "pallas" it runs the
    heuristic cluster size), "xla" (XLA's own ops in the input dtype, fp32 accumulation),
    "pallas" (XLA's ops around Pallas' split-K decode attention kernel; GPU only, a
    power-of-two head_dim and S_max a multiple of 16 with splits of whole 128-token blocks:
    attention_decode_xla.pallas_supported), "splitk" (XLA's ops around our split-K decode
    attention kernel, jax_cluster.ops.decode_attention; on a GPU head_dim 64/80/96/128 and
    at most 8 query heads per KV head), "reference" (plain jnp, fp32 math).
    """
    if x.ndim != 2:
        raise ValueError(f"attention_decode: x must be [B, D], got shape {x.shape}")
    if k_cache.ndim != 4:
        raise ValueError(f"attention_decode: k_cache must be [B, Hkv, S_max, Dh], got {k_cache.shape}")
    batch, hidden = x.shape
    _, hkv, max_seq, head_dim = k_cache.shape
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"attention_decode: num_q_heads ({num_q_heads}) must be a multiple of "
                         f"num_kv_heads ({num_kv_heads})")
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"attention_decode: x dtype must be float16, bfloat16 or float32, got {x.dtype}")
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 0 <= rotary_dim <= head_dim:
        raise ValueError(f"attention_decode: rotary_dim ({rotary_dim}) must be even and <= head_dim ({head_dim})")
    if norm not in NORMS:
        raise ValueError(f"attention_decode: norm must be one of {list(NORMS)}, got {norm!r}")
    if rope_layout not in ROPE_LAYOUTS:
        raise ValueError(f"attention_decode: rope_layout must be 'half' or 'interleaved', got {rope_layout!r}")
    dt = x.dtype
    cols = (num_q_heads + 2 * num_kv_heads) * head_dim
    _check("k_cache", k_cache, (batch, num_kv_heads, max_seq, head_dim), dt)
    _check("v_cache", v_cache, k_cache.shape, dt)
    _check("w_qkv", w_qkv, (hidden, cols), dt)
    _check("w_o", w_o, (num_q_heads * head_dim, hidden), dt)
    _check("qkv_bias", qkv_bias, (cols,), dt)
    _check("o_bias", o_bias, (hidden,), dt)
    _check("lengths", lengths, (batch,), jnp.int32)
    _check("inv_freq", inv_freq, (rotary_dim // 2,), jnp.float32)
    if norm is not None:
        if norm_weight is None:
            raise ValueError(f"attention_decode: norm={norm!r} needs norm_weight")
        _check("norm_weight", norm_weight, (hidden,), dt)
    if norm == "layer":
        if norm_bias is None:
            raise ValueError("attention_decode: norm='layer' needs norm_bias")
        _check("norm_bias", norm_bias, (hidden,), dt)
    if not isinstance(lengths, jax.core.Tracer):
        lens = np.asarray(lengths)
        if lens.size and (lens.min() < 0 or lens.max() >= max_seq):
            raise ValueError(f"attention_decode: lengths must be in [0, S_max={max_seq}) (the new token "
                             f"is written at lengths[b]); got min {lens.min()}, max {lens.max()}")
    if cluster_size is not None and cluster_size not in CLUSTER_SIZES:
        raise ValueError(f"attention_decode: cluster_size must be one of {CLUSTER_SIZES}, got {cluster_size}")
    if heads_per_cluster is not None and not 1 <= heads_per_cluster <= MAX_HEADS_PER_CLUSTER:
        raise ValueError(f"attention_decode: heads_per_cluster must be in 1..{MAX_HEADS_PER_CLUSTER}, "
                         f"got {heads_per_cluster}")
    if dataflow not in DATAFLOWS:
        raise ValueError(f"attention_decode: dataflow must be one of {list(DATAFLOWS)}, got {dataflow!r}")
    if cluster_size is not None and cluster_size not in POW2_CLUSTER_SIZES and (
            dataflow != "split_token" or (rows_per_cluster or 1) > 1):
        raise ValueError(f"attention_decode: cluster_size={cluster_size} (not a power of two) is for the "
                         "SplitToken kernels with rows_per_cluster=1 only")
    if dataflow == "split_head":
        if cluster_size is not None and head_dim % (8 * cluster_size):
            raise ValueError(f"attention_decode: dataflow='split_head' needs head_dim ({head_dim}) divisible "
                             f"by 8 * cluster_size ({cluster_size})")
        cluster_size = cluster_size or max(n for n in POW2_CLUSTER_SIZES if n <= 4 and head_dim % (8 * n) == 0)
    if pipeline is not None and pipeline not in PIPELINES:
        raise ValueError(f"attention_decode: pipeline must be one of {list(PIPELINES)} or None, "
                         f"got {pipeline!r}")
    if pipeline == "tma" and dataflow != "split_token":
        raise ValueError("attention_decode: pipeline='tma' is a SplitToken pipeline "
                         "(dataflow='split_token')")
    if rows_per_cluster is not None and rows_per_cluster not in ROWS_PER_CLUSTER:
        raise ValueError(f"attention_decode: rows_per_cluster must be one of {ROWS_PER_CLUSTER}, "
                         f"got {rows_per_cluster!r}")
    if (rows_per_cluster or 1) > 1 and dataflow != "split_token":
        raise ValueError("attention_decode: rows_per_cluster > 1 (the batch-tiled kernel) needs "
                         "dataflow='split_token'")
    if (rows_per_cluster or 1) > 1 and pipeline == "tma":
        raise ValueError("attention_decode: rows_per_cluster > 1 (the batch-tiled kernel) needs "
                         "pipeline='registers'")
    if impl not in IMPLS:
        raise ValueError(f"attention_decode: impl must be one of {IMPLS}, got {impl!r}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    kwargs = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, norm=norm,
                  norm_weight=norm_weight, norm_bias=norm_bias, eps=eps, qkv_bias=qkv_bias,
                  o_bias=o_bias, residual=residual, rotary_dim=rotary_dim,
                  rope_layout=rope_layout, scale=scale)
    if impl == "reference":
        return reference.attention_decode(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, **kwargs)
    if impl == "xla":
        return attention_decode_xla(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, **kwargs)
    on_gpu = jax.default_backend() == "gpu"
    if impl == "pallas":
        if not on_gpu:
            raise ValueError("attention_decode: impl='pallas' runs Pallas' GPU kernel; the backend "
                             f"is {jax.default_backend()!r}")
        return attention_decode_pallas(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, **kwargs)
    if impl == "splitk":
        return attention_decode_splitk(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, **kwargs)

    if on_gpu and (head_dim not in CUDA_HEAD_DIMS or hidden % 64 or jnp.dtype(dt) == jnp.float32):
        if impl == "kernel":
            raise ValueError(f"attention_decode: no CUDA kernel for head_dim={head_dim}, hidden={hidden}, "
                             f"dtype={jnp.dtype(dt).name} (supported: head_dim {CUDA_HEAD_DIMS}, "
                             "hidden % 64 == 0, fp16/bf16)")
        _warn_once((head_dim, hidden, str(dt)),
                   f"attention_decode: no CUDA kernel for head_dim={head_dim}, hidden={hidden}, "
                   f"dtype={jnp.dtype(dt).name}; using XLA's ops (impl='xla')")
        return attention_decode_xla(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, **kwargs)

    if cluster_size is None:
        choice = parse_choice(_choose_cluster_size(on_gpu, batch, hidden, num_q_heads,
                                                   num_kv_heads, max_seq, head_dim, dt))
        if isinstance(choice, str):  # UNFUSED: measured faster than every kernel configuration
            if impl != "kernel":
                step = {"pallas": attention_decode_pallas,  # only a candidate where Pallas takes this S_max
                        "splitk": attention_decode_splitk, "xla": attention_decode_xla}[choice]
                return step(x, w_qkv, w_o, k_cache, v_cache, lengths, inv_freq, **kwargs)
            choice = (default_cluster_size(batch, num_kv_heads, num_q_heads // num_kv_heads), None,
                      "registers", 1)
        cluster_size, tuned_heads, tuned_pipeline, tuned_rows = choice
        heads_per_cluster = heads_per_cluster or tuned_heads
        if dataflow == "split_token":
            rows_per_cluster = rows_per_cluster or tuned_rows
            pipeline = pipeline or (tuned_pipeline if rows_per_cluster == 1 else "registers")
    rows_per_cluster = rows_per_cluster or 1
    if rows_per_cluster > 1:
        group = num_q_heads // num_kv_heads
        _check_tiled_fits(hidden, rows_per_cluster,
                          _heads_per_cluster(group, heads_per_cluster or MAX_HEADS_PER_CLUSTER),
                          head_dim, cluster_size)
    empty = jnp.zeros((0,), dt)
    y, k, v, _ = _PRIM.bind(
        x, norm_weight if norm_weight is not None else empty,
        norm_bias if norm_bias is not None else empty, w_qkv,
        qkv_bias if qkv_bias is not None else empty, w_o,
        o_bias if o_bias is not None else empty, inv_freq, lengths, k_cache, v_cache,
        num_q_heads=int(num_q_heads), num_kv_heads=int(num_kv_heads), rotary_dim=int(rotary_dim),
        rope_layout=ROPE_LAYOUTS[rope_layout], norm=NORMS[norm], eps=np.float32(eps),
        scale=np.float32(scale), residual=bool(residual), has_qkv_bias=qkv_bias is not None,
        has_o_bias=o_bias is not None, cluster_size=int(cluster_size),
        max_heads_per_cluster=int(heads_per_cluster or MAX_HEADS_PER_CLUSTER),
        dataflow=DATAFLOWS[dataflow], pipeline=PIPELINES[pipeline or "registers"],
        rows_per_cluster=int(rows_per_cluster))
    return y, k, v
