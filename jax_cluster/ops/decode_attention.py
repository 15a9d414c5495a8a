"""decode_attention: the attention of one decode step over a KV cache, alone.

    out[b, g, h] = softmax(q[b, g, h] . K[b, g, 0..pos[b]]) V[b, g, 0..pos[b]]

q [B, Hkv, G, Dh] comes scaled (G query heads per KV head: GQA, MHA with G = 1, MQA with
Hkv = 1); caches [B, Hkv, S_max, Dh]; pos int32 [B]; a row whose pos is outside [0, S_max)
gets NaN. On a Hopper GPU this is a split-K ("flash-decoding") CUDA kernel: one block per
(token split, KV head, row) attends all G heads of its group, so each cache byte is read
once for the group (GQA on tensor cores, MHA on CUDA cores); with several splits a second
kernel merges them in a fixed order (no atomics: bitwise reproducible).

decode_attention_append is the same attention for a decode step's new token: it takes the
QKV projection's output, applies RoPE to q and k, writes k, v into the caches at slot
pos[b] (in place: donate the caches) and attends over the pos[b] cached tokens and the new
one, all in the same kernels. attention_decode's impl="splitk" runs it between XLA's
projections.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster._ffi import ffi_primitive, fold_batch_axis

ROPE_LAYOUTS = {"half": 0, "interleaved": 1}

CUDA_HEAD_DIMS = (64, 80, 96, 128)
MAX_GROUP = 8  # kDecodeAttentionMaxGroup
MAX_SPLITS = 1024  # kDecodeAttentionMaxSplits
MIN_SPLIT_TOKENS = 256


def default_splits(batch: int, num_kv_heads: int, max_seq: int, num_sms: int = 132) -> int:
    """Token splits per (row, KV head): about one block per SM in all (the kernel runs one
    block per SM for GQA groups: more splits only add partials to merge; H100, session 21:
    batch 16 with 8 KV heads was fastest unsplit, batch 1 with 8 KV heads at 16 splits),
    and no split shorter than MIN_SPLIT_TOKENS of S_max."""
    by_sms = max(1, round(num_sms / (batch * num_kv_heads)))
    by_len = max(1, -(-max_seq // MIN_SPLIT_TOKENS))
    return int(min(by_sms, by_len, MAX_SPLITS))


def _workspace_floats(q_shape, splits):
    b, hkv, g, dh = q_shape
    return b * hkv * splits * g * (dh + 2) + b * hkv * 2 * dh  # + the new k, v (append mode)


def _abstract(q, k_cache, v_cache, pos, *, splits):
    return (ShapedArray(q.shape, q.dtype),
            ShapedArray((_workspace_floats(q.shape, splits),), np.float32))


def _batching(args, dims, *, splits):
    """vmap: the mapped axis folds into the batch rows (one call over N * B rows)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    q, k, v, pos = (fold_batch_axis(a, d, size) for a, d in zip(args, dims))
    n, b = q.shape[:2]
    out, ws = _PRIM.bind(q.reshape((n * b,) + q.shape[2:]), k.reshape((n * b,) + k.shape[2:]),
                         v.reshape((n * b,) + v.shape[2:]), pos.reshape(n * b), splits=splits)
    return (out.reshape(q.shape), ws.reshape(n, -1)), (0, 0)


_PRIM = ffi_primitive("decode_attention", abstract_eval=_abstract, batching_rule=_batching)


def cuda_supported(head_dim: int, group: int, dtype) -> bool:
    """Whether the CUDA kernel takes these shapes (the CPU handler takes every shape)."""
    return (head_dim in CUDA_HEAD_DIMS and 1 <= group <= MAX_GROUP
            and jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)))


def _checked_splits(op: str, k_cache, group: int, splits) -> int:
    """The checks both ops share (group size; a CUDA kernel for these shapes on a GPU) and
    their token splits: `splits`, validated, or default_splits."""
    b, hkv, max_seq, dh = k_cache.shape
    if group > MAX_GROUP:
        raise ValueError(f"{op}: at most {MAX_GROUP} query heads per KV head, got {group}")
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and not cuda_supported(dh, group, k_cache.dtype):
        raise ValueError(f"{op}: no CUDA kernel for head_dim={dh}, dtype={jnp.dtype(k_cache.dtype).name} "
                         f"(supported: head_dim {CUDA_HEAD_DIMS}, float16 or bfloat16)")
    if splits is None:
        sms = getattr(jax.devices()[0], "core_count", 132) if on_gpu else 132
        return default_splits(b, hkv, max_seq, sms)
    if not isinstance(splits, (int, np.integer)) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"{op}: splits must be an int in 1..{MAX_SPLITS}, got {splits!r}")
    return int(splits)


def decode_attention(q, k_cache, v_cache, pos, *, splits: int | None = None):
    """out [B, Hkv, G, Dh] in q's dtype; see the module docstring. splits: token splits per
    (row, KV head), 1..1024 (None: default_splits). On a GPU: head_dim 64, 80, 96 or 128,
    G <= 8, float16 or bfloat16; the CPU handler (fp32 math) takes any shape and float32."""
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"decode_attention: q must be [B, Hkv, G, Dh] and k_cache [B, Hkv, S_max, Dh]; "
                         f"got {q.shape} and {k_cache.shape}")
    b, hkv, group, dh = q.shape
    if k_cache.shape[:2] != (b, hkv) or k_cache.shape[3] != dh:
        raise ValueError(f"decode_attention: k_cache {k_cache.shape} does not match q {q.shape} "
                         "([B, Hkv, S_max, Dh] against [B, Hkv, G, Dh])")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention: v_cache {v_cache.shape} must match k_cache {k_cache.shape}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"decode_attention: q, k_cache and v_cache must share a dtype; got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if pos.shape != (b,) or pos.dtype != jnp.int32:
        raise ValueError(f"decode_attention: pos must be int32 [{b}], got {pos.dtype} {pos.shape}")
    splits = _checked_splits("decode_attention", k_cache, group, splits)
    out, _ = _PRIM.bind(q, k_cache, v_cache, pos, splits=splits)
    return out


def _append_abstract(qkv, k_cache, v_cache, pos, inv_freq, *, splits, num_q_heads, rotary_dim,
                     rope_layout, scale):
    b, hkv, _, dh = k_cache.shape
    q_shape = (b, hkv, num_q_heads // hkv, dh)
    return (ShapedArray(q_shape, k_cache.dtype), ShapedArray(k_cache.shape, k_cache.dtype),
            ShapedArray(v_cache.shape, v_cache.dtype),
            ShapedArray((_workspace_floats(q_shape, splits),), np.float32))


def _append_batching(args, dims, **params):
    """vmap: the mapped axis folds into the batch rows (inv_freq is shared: not mapped)."""
    if dims[4] is not None:
        raise NotImplementedError("decode_attention_append: vmap over inv_freq is not supported")
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    qkv, k, v, pos = (fold_batch_axis(a, d, size) for a, d in zip(args[:4], dims[:4]))
    n, b = k.shape[:2]
    flat = lambda a: a.reshape((n * b,) + a.shape[2:])  # noqa: E731
    out, k2, v2, ws = _APPEND.bind(flat(qkv), flat(k), flat(v), pos.reshape(n * b), args[4], **params)
    return ((out.reshape((n, b) + out.shape[1:]), k2.reshape(k.shape), v2.reshape(v.shape),
             ws.reshape(n, -1)), (0, 0, 0, 0))


_APPEND = ffi_primitive("decode_attention_append", abstract_eval=_append_abstract,
                        batching_rule=_append_batching, operand_output_aliases={1: 1, 2: 2})


def decode_attention_append(qkv, k_cache, v_cache, pos, inv_freq, *, num_q_heads: int,
                            scale: float, rotary_dim: int | None = None, rope_layout: str = "half",
                            splits: int | None = None):
    """(out [B, Hkv, G, Dh], k_cache, v_cache): one decode step's attention with its new
    token (see the module docstring). qkv float32 [B, (Hq + 2 Hkv) Dh], columns [Q heads |
    K heads | V heads] (the projection's output, bias included); caches [B, Hkv, S_max, Dh]
    (fp16/bf16 on a GPU), updated at slot pos[b] only; pos int32 [B] (the cached tokens;
    rows outside [0, S_max) get NaN and write nothing); inv_freq float32 [rotary_dim / 2];
    scale multiplies q . k."""
    if k_cache.ndim != 4 or v_cache.shape != k_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"decode_attention_append: caches must be two [B, Hkv, S_max, Dh] arrays of one "
                         f"dtype; got {k_cache.shape} {k_cache.dtype} and {v_cache.shape} {v_cache.dtype}")
    b, hkv, _, dh = k_cache.shape
    if num_q_heads < 1 or num_q_heads % hkv:
        raise ValueError(f"decode_attention_append: num_q_heads ({num_q_heads}) must be a multiple of "
                         f"the caches' {hkv} KV heads")
    group = num_q_heads // hkv
    if qkv.shape != (b, (num_q_heads + 2 * hkv) * dh) or qkv.dtype != jnp.float32:
        raise ValueError(f"decode_attention_append: qkv must be float32 [{b}, {(num_q_heads + 2 * hkv) * dh}], "
                         f"got {qkv.dtype} {qkv.shape}")
    if pos.shape != (b,) or pos.dtype != jnp.int32:
        raise ValueError(f"decode_attention_append: pos must be int32 [{b}], got {pos.dtype} {pos.shape}")
    rotary_dim = dh if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 0 <= rotary_dim <= dh or inv_freq.shape != (rotary_dim // 2,) \
            or inv_freq.dtype != jnp.float32:
        raise ValueError(f"decode_attention_append: rotary_dim ({rotary_dim}) must be even and <= head_dim "
                         f"({dh}), inv_freq float32 [{rotary_dim // 2}]; got {inv_freq.dtype} {inv_freq.shape}")
    if rope_layout not in ROPE_LAYOUTS:
        raise ValueError(f"decode_attention_append: rope_layout must be 'half' or 'interleaved', got {rope_layout!r}")
    splits = _checked_splits("decode_attention_append", k_cache, group, splits)
    out, k, v, _ = _APPEND.bind(qkv, k_cache, v_cache, pos, inv_freq, splits=splits,
                                num_q_heads=int(num_q_heads), rotary_dim=int(rotary_dim),
                                rope_layout=ROPE_LAYOUTS[rope_layout], scale=np.float32(scale))
    return out, k, v
