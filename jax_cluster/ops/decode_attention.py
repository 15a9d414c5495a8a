"""decode_attention: the attention of one decode step over a KV cache, alone.

    out[b, g, h] = softmax(q[b, g, h] . K[b, g, 0..lengths[b]]) V[b, g, 0..lengths[b]]

q [B, Hkv, G, Dh] comes scaled (G query heads per KV head: GQA, MHA with G = 1, MQA with
Hkv = 1); caches [B, Hkv, S_max, Dh]; lengths int32 [B] (tokens cached before this step:
the step's token sits at slot lengths[b], so the attention covers lengths[b] + 1 slots). A
row whose lengths are outside [0, S_max) gets NaN. On a Hopper GPU this is a split-K
("flash-decoding") CUDA kernel: one block per (token split, KV head, row) attends all G
heads of its group, so each cache byte is read once for the group (GQA on tensor cores,
MHA on CUDA cores); with several splits a second kernel merges them in a fixed order (no
atomics: bitwise reproducible).

decode_attention_append is the same attention for a decode step's new token: it takes the
QKV projection's output, applies RoPE to q and k, writes k, v into the caches at slot
lengths[b] (in place: donate the caches) and attends over the lengths[b] cached tokens and
the new one, all in the same kernels. attention_block's kernel="split_k" runs it between
XLA's projections.

`impl` has the meaning of every op (docs/architecture.md): "auto" the CUDA kernels where
they take the shape (else "xla" with a one-time warning), "cuda" the custom call (the C++
handler on CPU), "xla" XLA's einsums in the input dtype, "reference" fp32 jnp.
DecodeAttentionConfig(splits=...) fixes the token splits (default: default_splits).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster import _extension, reference
from jax_cluster._ffi import (check_call, ffi_primitive, fold_batch_axis, num_sms,
                              on_gpu, warn_once)
from jax_cluster._sharding import row_partitioned

ROPE_LAYOUTS = {"half": 0, "interleaved": 1}
MIN_SPLIT_TOKENS = 256


@functools.cache
def _constants() -> dict:
    return dict(_extension.plans().decode_attention_constants())


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """How decode_attention runs on the GPU (impl="auto" or "cuda").

    splits  token splits per (row, KV head), 1..1024; None: default_splits (about one
            block per SM in all, no split shorter than 256 slots of S_max).
    """

    splits: int | None = None

    def __post_init__(self):
        if self.splits is None:
            return
        if isinstance(self.splits, bool) or not isinstance(self.splits, (int, np.integer)):
            raise TypeError(f"DecodeAttentionConfig: splits must be an int or None, got {self.splits!r}")
        if not 1 <= self.splits <= _constants()["max_splits"]:
            raise ValueError(f"DecodeAttentionConfig: splits must be in 1..{_constants()['max_splits']}, "
                             f"got {self.splits}")


def default_splits(batch: int, num_kv_heads: int, max_seq: int, num_sms: int = 132) -> int:
    """Token splits per (row, KV head): about one block per SM in all (the kernel runs one
    block per SM for GQA groups: more splits only add partials to merge; on H100 batch 16
    with 8 KV heads was fastest unsplit, batch 1 with 8 KV heads at 16 splits), and no
    split shorter than MIN_SPLIT_TOKENS of S_max."""
    by_sms = max(1, round(num_sms / (batch * num_kv_heads)))
    by_len = max(1, -(-max_seq // MIN_SPLIT_TOKENS))
    return int(min(by_sms, by_len, _constants()["max_splits"]))


def _workspace_floats(q_shape, k_cache, splits, append=False, rotary_dim=0) -> int:
    """The kernels' fp32 workspace (cpp/ops/decode_attention: partial states of every split,
    and the new k, v in append mode)."""
    b, hkv, g, dh = q_shape
    plan = _plan(b, hkv, g, dh, k_cache.shape[2], k_cache.dtype, splits, append, rotary_dim)
    return int(plan["workspace_floats"])


def _abstract(q, k_cache, v_cache, lengths, *, splits):
    return (ShapedArray(q.shape, q.dtype),
            ShapedArray((_workspace_floats(q.shape, k_cache, splits),), np.float32))


def _batching(args, dims, *, splits):
    """vmap: the mapped axis folds into the batch rows (one call over N * B rows)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    q, k, v, lengths = (fold_batch_axis(a, d, size) for a, d in zip(args, dims))
    n, b = q.shape[:2]
    out, ws = _PRIM.bind(q.reshape((n * b,) + q.shape[2:]), k.reshape((n * b,) + k.shape[2:]),
                         v.reshape((n * b,) + v.shape[2:]), lengths.reshape(n * b), splits=splits)
    return (out.reshape(q.shape), ws.reshape(n, -1)), (0, 0)


_PRIM = ffi_primitive("decode_attention", abstract_eval=_abstract, batching_rule=_batching)


def _plan(batch, num_kv_heads, group, head_dim, max_seq, dtype, splits, append=False, rotary_dim=0) -> dict:
    return dict(_extension.plans().decode_attention(batch, num_kv_heads, group, head_dim, max_seq,
                                                    jnp.dtype(dtype).name, splits, append, rotary_dim))


def kernel_error(*, group: int, head_dim: int, dtype, rotary_dim: int = 0, append: bool = False) -> str:
    """Why the CUDA kernels cannot run a step with this group, head_dim and dtype ('' when
    they can; the sizes the kernels cover do not depend on batch or cache length)."""
    plan = _plan(1, 1, group, head_dim, 1, dtype, 1, append, rotary_dim)
    return plan["error"] or plan["cuda_error"]


def _use_kernel(op: str, impl: str, k_cache, group: int, config, *, append=False, rotary_dim=0):
    """The token splits to launch with, or None for XLA's einsums (impl="xla"/"reference",
    or "auto" where the kernels do not take the shape: a one-time warning; "cuda" raises).
    impl and config are checked already (check_call)."""
    if impl in ("xla", "reference"):
        return None
    b, hkv, max_seq, dh = k_cache.shape
    splits = config.splits if config is not None and config.splits is not None else \
        default_splits(b, hkv, max_seq, num_sms())
    plan = _plan(b, hkv, group, dh, max_seq, k_cache.dtype, splits, append, rotary_dim)
    why_not = plan["error"] or (plan["cuda_error"] if on_gpu() else "")
    if why_not:
        if impl == "cuda":
            raise ValueError(f"{op}: {why_not}")
        warn_once((op, dh, group, jnp.dtype(k_cache.dtype).name),
                  f"{op}: {why_not}; using XLA's ops (impl='xla')")
        return None
    return splits


def _attend_xla(q, k_cache, v_cache, lengths):
    """XLA's einsums in the input dtype (fp32 accumulation and softmax)."""
    f32 = jnp.float32
    s = jnp.einsum("bhgd,bhsd->bhgs", q, k_cache, preferred_element_type=f32)
    s = jnp.where(jnp.arange(k_cache.shape[2]) <= lengths[:, None, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    out = jnp.einsum("bhgs,bhsd->bhgd", p, v_cache, preferred_element_type=f32)
    valid = (lengths >= 0) & (lengths < k_cache.shape[2])
    return jnp.where(valid[:, None, None, None], out, jnp.nan).astype(q.dtype)


def check_lengths(op: str, lengths, batch: int, max_seq: int, rolling: bool = False) -> None:
    """Shape and dtype; the values too where they are known (under jit they are traced: an
    out-of-range row then gives NaN and writes nothing). Over a rolling buffer any length >= 0
    is valid."""
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        raise ValueError(f"{op}: lengths must be int32 [{batch}], got {jnp.dtype(lengths.dtype).name} "
                         f"{tuple(lengths.shape)}")
    if not isinstance(lengths, jax.core.Tracer):
        lens = np.asarray(lengths)
        if rolling and lens.size and lens.min() < 0:
            raise ValueError(f"{op}: lengths must be >= 0; got min {lens.min()}")
        if not rolling and lens.size and (lens.min() < 0 or lens.max() >= max_seq):
            raise ValueError(f"{op}: lengths must be in [0, S_max={max_seq}); got min {lens.min()}, "
                             f"max {lens.max()}")


def decode_attention(q, k_cache, v_cache, lengths, *, impl: str = "auto",
                     config: DecodeAttentionConfig | None = None):
    """out [B, Hkv, G, Dh] in q's dtype; see the module docstring. On a GPU the kernels take
    head_dim 64, 80, 96, 128 or 256, G <= 8, float16 or bfloat16; the CPU handler (fp32 math)
    takes any shape and float32."""
    op = "decode_attention"
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"{op}: q must be [B, Hkv, G, Dh] and k_cache [B, Hkv, S_max, Dh]; "
                         f"got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    b, hkv, group, dh = q.shape
    if k_cache.shape[:2] != (b, hkv) or k_cache.shape[3] != dh:
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)} "
                         "([B, Hkv, S_max, Dh] against [B, Hkv, G, Dh])")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"{op}: q, k_cache and v_cache must share a dtype; got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    check_lengths(op, lengths, b, k_cache.shape[2])
    check_call(op, impl, config, DecodeAttentionConfig)
    if b == 0:  # no rows: nothing to launch
        return jnp.zeros(q.shape, q.dtype)
    splits = _use_kernel(op, impl, k_cache, group, config)
    if impl == "reference":
        return reference.decode_attention(q, k_cache, v_cache, lengths)
    if splits is None:
        return _attend_xla(q, k_cache, v_cache, lengths)
    attend = lambda *a: _PRIM.bind(*a, splits=splits)[:1]  # noqa: E731
    return row_partitioned(attend, (True,) * 4, (True,))(q, k_cache, v_cache, lengths)[0]


def _append_abstract(qkv, k_cache, v_cache, lengths, inv_freq, *, splits, num_q_heads, rotary_dim,
                     rope_layout, scale, rolling):
    b, hkv, _, dh = k_cache.shape
    q_shape = (b, hkv, num_q_heads // hkv, dh)
    return (ShapedArray(q_shape, k_cache.dtype), ShapedArray(k_cache.shape, k_cache.dtype),
            ShapedArray(v_cache.shape, v_cache.dtype),
            ShapedArray((_workspace_floats(q_shape, k_cache, splits, True, rotary_dim),), np.float32))


def _append_batching(args, dims, **params):
    """vmap: the mapped axis folds into the batch rows (inv_freq is shared: not mapped)."""
    if dims[4] is not None:
        raise NotImplementedError("decode_attention_append: vmap over inv_freq is not supported")
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    qkv, k, v, lengths = (fold_batch_axis(a, d, size) for a, d in zip(args[:4], dims[:4]))
    n, b = k.shape[:2]
    flat = lambda a: a.reshape((n * b,) + a.shape[2:])  # noqa: E731
    out, k2, v2, ws = _APPEND.bind(flat(qkv), flat(k), flat(v), lengths.reshape(n * b), args[4], **params)
    return ((out.reshape((n, b) + out.shape[1:]), k2.reshape(k.shape), v2.reshape(v.shape),
             ws.reshape(n, -1)), (0, 0, 0, 0))


_APPEND = ffi_primitive("decode_attention_append", abstract_eval=_append_abstract,
                        batching_rule=_append_batching, operand_output_aliases={1: 1, 2: 2})


def _append_xla(qkv, k_cache, v_cache, lengths, inv_freq, *, num_q_heads, scale, rotary_dim,
                rope_layout, rolling=False):
    """decode_attention_append with XLA's ops (RoPE in fp32, the cache write one scatter)."""
    batch, hkv, max_seq, dh = k_cache.shape
    valid, pos, slot, last = reference.append_slots(lengths, max_seq, rolling)
    rope = lambda v: reference._rope(v, pos[:, None], inv_freq, rotary_dim, rope_layout)  # noqa: E731
    q = rope(qkv[:, :num_q_heads * dh].reshape(batch, num_q_heads, dh))
    k = rope(qkv[:, num_q_heads * dh:(num_q_heads + hkv) * dh].reshape(batch, hkv, dh))
    v = qkv[:, (num_q_heads + hkv) * dh:].reshape(batch, hkv, dh)
    slot = jnp.where(valid, slot, max_seq)[:, None]  # invalid rows point past S_max: dropped
    rows, heads = jnp.arange(batch)[:, None], jnp.arange(hkv)[None, :]
    k_cache = k_cache.at[rows, heads, slot].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, heads, slot].set(v.astype(v_cache.dtype), mode="drop")
    q = (q * scale).astype(k_cache.dtype).reshape(batch, hkv, num_q_heads // hkv, dh)
    return _attend_xla(q, k_cache, v_cache, last), k_cache, v_cache


def decode_attention_append(qkv, k_cache, v_cache, lengths, inv_freq, *, num_q_heads: int,
                            scale: float, rotary_dim: int | None = None, rope_layout: str = "half",
                            rolling: bool = False, impl: str = "auto",
                            config: DecodeAttentionConfig | None = None):
    """(out [B, Hkv, G, Dh], k_cache, v_cache): one decode step's attention with its new
    token (see the module docstring). qkv float32 [B, (Hq + 2 Hkv) Dh], columns [Q heads |
    K heads | V heads] (the projection's output, bias included); caches [B, Hkv, S_max, Dh]
    (fp16/bf16 on a GPU), updated at slot lengths[b] only; lengths int32 [B] (the cached
    tokens; rows outside [0, S_max) get NaN and write nothing); inv_freq float32
    [rotary_dim / 2]; scale multiplies q . k.

    rolling=True: the caches are a sliding window's rolling buffer of S_max slots (position t
    in slot t % S_max; once full they hold exactly the window): the new token, RoPE'd at
    position lengths[b], goes to slot lengths[b] % S_max and attends the min(lengths[b],
    S_max - 1) + 1 filled slots; any lengths[b] >= 0 is valid."""
    op = "decode_attention_append"
    if k_cache.ndim != 4 or v_cache.shape != k_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{op}: caches must be two [B, Hkv, S_max, Dh] arrays of one dtype; got "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    b, hkv, _, dh = k_cache.shape
    if num_q_heads < 1 or num_q_heads % hkv:
        raise ValueError(f"{op}: num_q_heads ({num_q_heads}) must be a multiple of the caches' {hkv} "
                         "KV heads")
    group = num_q_heads // hkv
    if qkv.shape != (b, (num_q_heads + 2 * hkv) * dh) or qkv.dtype != jnp.float32:
        raise ValueError(f"{op}: qkv must be float32 [{b}, {(num_q_heads + 2 * hkv) * dh}], "
                         f"got {jnp.dtype(qkv.dtype).name} {tuple(qkv.shape)}")
    check_lengths(op, lengths, b, k_cache.shape[2], bool(rolling))
    rotary_dim = dh if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 0 <= rotary_dim <= dh or inv_freq.shape != (rotary_dim // 2,) \
            or inv_freq.dtype != jnp.float32:
        raise ValueError(f"{op}: rotary_dim ({rotary_dim}) must be even and <= head_dim ({dh}), "
                         f"inv_freq float32 [{rotary_dim // 2}]; got {jnp.dtype(inv_freq.dtype).name} "
                         f"{tuple(inv_freq.shape)}")
    if rope_layout not in ROPE_LAYOUTS:
        raise ValueError(f"{op}: rope_layout must be 'half' or 'interleaved', got {rope_layout!r}")
    check_call(op, impl, config, DecodeAttentionConfig)
    if b == 0:  # no rows: nothing to launch, the caches unchanged
        return jnp.zeros((0, hkv, num_q_heads // hkv, dh), k_cache.dtype), k_cache, v_cache
    splits = _use_kernel(op, impl, k_cache, group, config, append=True, rotary_dim=rotary_dim)
    kw = dict(num_q_heads=num_q_heads, scale=scale, rotary_dim=rotary_dim, rope_layout=rope_layout,
              rolling=bool(rolling))
    if impl == "reference":
        return reference.decode_attention_append(qkv, k_cache, v_cache, lengths, inv_freq, **kw)
    if splits is None:
        return _append_xla(qkv, k_cache, v_cache, lengths, inv_freq, **kw)
    append = functools.partial(_APPEND.bind, splits=splits, num_q_heads=int(num_q_heads), rotary_dim=int(rotary_dim),
                               rope_layout=ROPE_LAYOUTS[rope_layout], scale=np.float32(scale),
                               rolling=bool(rolling))
    return row_partitioned(lambda *a: append(*a)[:3], (True,) * 4 + (False,), (True,) * 3)(
        qkv, k_cache, v_cache, lengths, inv_freq)
