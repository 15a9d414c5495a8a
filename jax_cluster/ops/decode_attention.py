"""decode_attention: the attention of one decode step over a KV cache, alone.

    out[b, g, h] = softmax(q[b, g, h] . K[b, g, 0..pos[b]]) V[b, g, 0..pos[b]]

q [B, Hkv, G, Dh] comes scaled (G query heads per KV head: GQA, MHA with G = 1, MQA with
Hkv = 1); caches [B, Hkv, S_max, Dh]; pos int32 [B]; a row whose pos is outside [0, S_max)
gets NaN. On a Hopper GPU this is a split-K ("flash-decoding") CUDA kernel: one block per
(token split, KV head, row) attends all G heads of its group, so each cache byte is read
once for the group; a second kernel merges the splits in a fixed order (no atomics:
bitwise reproducible). attention_decode's impl="splitk" runs it between XLA's projections.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster.ops._primitive import ffi_primitive, fold_batch_axis

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
    return b * hkv * splits * g * (dh + 2)


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
    if group > MAX_GROUP:
        raise ValueError(f"decode_attention: at most {MAX_GROUP} query heads per KV head, got {group}")
    max_seq = k_cache.shape[2]
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and not cuda_supported(dh, group, q.dtype):
        raise ValueError(f"decode_attention: no CUDA kernel for head_dim={dh}, dtype={jnp.dtype(q.dtype).name} "
                         f"(supported: head_dim {CUDA_HEAD_DIMS}, float16 or bfloat16)")
    if splits is None:
        sms = getattr(jax.devices()[0], "core_count", 132) if on_gpu else 132
        splits = default_splits(b, hkv, max_seq, sms)
    if not isinstance(splits, (int, np.integer)) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"decode_attention: splits must be an int in 1..{MAX_SPLITS}, got {splits!r}")
    out, _ = _PRIM.bind(q, k_cache, v_cache, pos, splits=int(splits))
    return out
