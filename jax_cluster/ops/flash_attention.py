"""flash_attention: non-causal attention of several query chunks over several KV chunks in
ONE launch, folded into a running (o, lse) state per query chunk (StreamFusion App. C,
Algorithm 2: the local kernel of the Ring / Torus schedules in jax_cluster.parallel).

    for each query chunk i:  s = scale * q_i k^T   over the keys of EVERY kv chunk
                             new = (softmax(s) v, logsumexp(s))
                             state_i = merge(state_i, new)     (log-sum-exp / sigmoid form)

q chunks [B, Lq_i, H, Dh] and kv chunks (k, v) [B, Lk_j, H, Dh] may have different lengths
(0 included) but share B, H, Dh and the dtype. A state is ``State(o, lse)``: o fp32
[B, Lq, H, Dh] NORMALIZED (softmax-weighted mean of V over the keys seen), lse fp32 [B, H, Lq]
natural log; lse = -inf is an empty row (its o is ignored); ``None`` = empty.

On a Hopper GPU this is one launch over every (query tile, head, batch), for Dh 64 / 128 and
fp16 / bf16: by default the FlashAttention-3 style kernel (TMA into an mbarrier ring fed by a
producer warp, wgmma on two consumer warpgroups with setmaxnreg, the softmax overlapped with
the GEMMs, ping-pong between the warpgroups); the mma.sync m16n8k16 kernel (FlashAttention-2
style, cp.async double buffering) serves what the first does not (a negative scale) and can be
asked for with ``cuda_kernel="mma"``. The chunks' tensor maps and pointers are kernel
parameters (no concatenation up to 32 query and 32 KV chunks per launch). Other head dims or fp32 run the blocked jnp path
(:func:`jax_cluster.parallel.attend`) with a one-time warning. On CPU a plain C++ handler
computes the same for any head dim and fp32 too.

Registered as the ``"flash_attention"`` kernel of :mod:`jax_cluster.parallel` (the hook
``kernel(q, kv_chunks, state, *, scale) -> State``), its default local kernel.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster import reference
from jax_cluster._ffi import ffi_primitive
from jax_cluster.parallel import local_attention as la
from jax_cluster.parallel.local_attention import State

CUDA_HEAD_DIMS = (64, 128)
MAX_Q_CHUNKS = 32  # mirrors kFlashMaxQChunks / kFlashMaxKVChunks (cpp/kernels/flash_attention.h)
MAX_KV_CHUNKS = 32
IMPLS = ("auto", "kernel", "jnp", "reference")
# cuda_kernel -> the FFI attribute `kernel` (FlashKernel in cpp/kernels/flash_attention.h)
CUDA_KERNELS = {"auto": 0, "wgmma": 1, "mma": 2}
_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _abstract(*args, num_q, num_kv, state_mask, scale, finalize, kernel):
    del num_kv, state_mask, scale, kernel
    outs = []
    for q in args[:num_q]:
        b, lq, h, _ = q.shape
        outs.append(ShapedArray(q.shape, q.dtype if finalize else jnp.float32))
        outs.append(ShapedArray((b, h, lq), jnp.float32))
    return tuple(outs)


def _batching(args, dims, **params):
    """vmap: every operand and result is per batch row (leading axis B), so the mapped axis
    folds into B (unmapped operands are broadcast) and the call stays one launch."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = []
    for a, d in zip(args, dims):
        a = jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0)
        folded.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
    outs = _PRIM.bind(*folded, **params)
    return [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs], [0] * len(outs)


_PRIM = ffi_primitive("flash_attention", abstract_eval=_abstract, batching_rule=_batching)

_warned: set = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


def _fail(message):
    raise ValueError(f"flash_attention: {message}")


def _normalize_states(state, qs, single):
    """One (o fp32, lse fp32) or None per query chunk, shapes checked."""
    if single:
        states = [state]
    elif state is None:
        states = [None] * len(qs)
    else:
        states = list(state)
        if len(states) != len(qs):
            _fail(f"state has {len(states)} entries for {len(qs)} query chunks")
    out = []
    for i, (st, q) in enumerate(zip(states, qs)):
        name = "state" if single else f"state[{i}]"
        if st is None:
            out.append(None)
            continue
        if not isinstance(st, (tuple, list)) or len(st) != 2:
            _fail(f"{name} must be State(o, lse) or None, got {type(st).__name__}")
        o, lse = st
        b, lq, h, d = q.shape
        if tuple(o.shape) != (b, lq, h, d):
            _fail(f"{name}.o has shape {tuple(o.shape)}, expected [B, Lq, H, Dh] = {(b, lq, h, d)}")
        if tuple(lse.shape) != (b, h, lq):
            _fail(f"{name}.lse has shape {tuple(lse.shape)}, expected [B, H, Lq] = {(b, h, lq)}")
        for part, x in (("o", o), ("lse", lse)):
            if not jnp.issubdtype(x.dtype, jnp.floating):
                _fail(f"{name}.{part} must be floating point (float32), got {x.dtype}")
        out.append((jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32)))
    return out


def _check_inputs(qs, kv_chunks, single):
    if not qs:
        _fail("q must be an array [B, Lq, H, Dh] or a non-empty sequence of them")
    q0 = qs[0]
    for i, q in enumerate(qs):
        name = "q" if single else f"q[{i}]"
        if getattr(q, "ndim", None) != 4:
            _fail(f"{name} must be [B, Lq, H, Dh], got shape {getattr(q, 'shape', type(q).__name__)}")
        if jnp.dtype(q.dtype) not in _DTYPES:
            _fail(f"{name} dtype must be float16, bfloat16 or float32, got {q.dtype}")
        if q.dtype != q0.dtype:
            _fail(f"{name} has dtype {q.dtype}, expected {q0.dtype} (q[0]'s)")
        if (q.shape[0], q.shape[2], q.shape[3]) != (q0.shape[0], q0.shape[2], q0.shape[3]):
            _fail(f"{name} has shape {tuple(q.shape)}: B, H, Dh must match q[0] {tuple(q0.shape)}")
    if q0.shape[3] < 1:
        _fail(f"head_dim must be >= 1, got shape {tuple(q0.shape)}")
    b, _, h, d = q0.shape
    kvs = []
    for j, kv in enumerate(kv_chunks):
        if not isinstance(kv, (tuple, list)) or len(kv) != 2:
            _fail(f"kv_chunks[{j}] must be a pair (k, v), got {type(kv).__name__}")
        k, v = kv
        for part, x in (("k", k), ("v", v)):
            if getattr(x, "ndim", None) != 4 or x.shape[0] != b or tuple(x.shape[2:]) != (h, d):
                _fail(f"kv_chunks[{j}] {part} has shape {getattr(x, 'shape', None)}, expected "
                      f"[B={b}, Lk, H={h}, Dh={d}]")
            if x.dtype != q0.dtype:
                _fail(f"kv_chunks[{j}] {part} has dtype {x.dtype}, expected q's {q0.dtype}")
        if k.shape[1] != v.shape[1]:
            _fail(f"kv_chunks[{j}]: k has {k.shape[1]} keys but v has {v.shape[1]}")
        kvs.append((k, v))
    return kvs


def _jnp_path(qs, kvs, states, scale, finalize):
    """The blocked jnp path of jax_cluster.parallel (bounded memory), per query chunk."""
    out = []
    for q, st in zip(qs, states):
        s = la.attend(q, kvs, None if st is None else State(*st), scale=scale)
        out.append(la.finalize(s, q.dtype) if finalize else s)
    return out


def _kernel_path(qs, kvs, states, scale, finalize, kernel=0):
    # More chunks than one launch takes: concatenate (a copy, but still one launch).
    if len(qs) > MAX_Q_CHUNKS:
        b, _, h, d = qs[0].shape
        lens = [q.shape[1] for q in qs]
        full = [st if st is not None else la.empty_state(b, n, h, d) for st, n in zip(states, lens)]
        st = (jnp.concatenate([s[0] for s in full], 1), jnp.concatenate([s[1] for s in full], 2))
        (res,) = _kernel_path([jnp.concatenate(qs, 1)], kvs, [st], scale, finalize, kernel)
        cuts = np.cumsum([0] + lens)
        if finalize:
            return [res[:, a:c] for a, c in zip(cuts[:-1], cuts[1:])]
        return [State(res.o[:, a:c], res.lse[:, :, a:c]) for a, c in zip(cuts[:-1], cuts[1:])]
    if len(kvs) > MAX_KV_CHUNKS:
        kvs = [(jnp.concatenate([k for k, _ in kvs], 1), jnp.concatenate([v for _, v in kvs], 1))]
    mask = sum(1 << i for i, st in enumerate(states) if st is not None)
    operands = list(qs) + [k for k, _ in kvs] + [v for _, v in kvs]
    for st in states:
        if st is not None:
            operands += [st[0], st[1]]
    outs = _PRIM.bind(*operands, num_q=len(qs), num_kv=len(kvs), state_mask=int(mask),
                      scale=np.float32(scale), finalize=bool(finalize), kernel=int(kernel))
    if finalize:
        return list(outs[0::2])
    return [State(o, lse) for o, lse in zip(outs[0::2], outs[1::2])]


def flash_attention(
    q,
    kv_chunks: Sequence,
    state=None,
    *,
    scale: float | None = None,
    finalize: bool = False,
    impl: str = "auto",
    cuda_kernel: str = "auto",
):
    """Attention of query chunk(s) over every (k, v) chunk, merged into the incoming state.

    q          [B, Lq, H, Dh] (fp16 / bf16 / fp32), or a sequence of such query chunks
               (Lq may differ between chunks, and be 0)
    kv_chunks  sequence of (k, v), each [B, Lk_j, H, Dh] in q's dtype (Lk_j may be 0)
    state      for one q: ``State(o, lse)`` or None; for a sequence: None or one entry
               (State or None) per chunk. o fp32 [B, Lq, H, Dh] normalized, lse fp32 [B, H, Lq]
    scale      softmax scale (default 1 / sqrt(Dh))
    finalize   False: the merged ``State`` (fp32); True: the attention output in q's dtype
               (0 where no key and no state was seen)
    impl       "auto" (the CUDA kernel where supported, else the jnp path with a one-time
               warning; the CPU handler on CPU), "kernel" (the FFI op; an error where the GPU
               has no kernel), "jnp" (blocked jnp path), "reference" (dense jnp reference)
    cuda_kernel which CUDA kernel the op runs (tests, benchmarks): "auto" (the wgmma kernel
               where it serves the call, else the mma.sync one), "wgmma", "mma",
               "wgmma_no_pingpong" (the wgmma kernel without its warpgroup ping-pong)
    Returns one result for an array q, a list for a sequence.
    """
    single = not isinstance(q, (list, tuple))
    qs = [q] if single else list(q)
    kvs = _check_inputs(qs, list(kv_chunks), single)
    states = _normalize_states(state, qs, single)
    d = qs[0].shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if not isinstance(scale, (int, float, np.floating, np.integer)) or not math.isfinite(float(scale)):
        _fail(f"scale must be a finite Python float, got {scale!r}")
    scale = float(scale)
    if impl not in IMPLS:
        _fail(f"impl must be one of {IMPLS}, got {impl!r}")
    if cuda_kernel not in CUDA_KERNELS:
        _fail(f"cuda_kernel must be one of {tuple(CUDA_KERNELS)}, got {cuda_kernel!r}")

    if impl == "reference":
        res = reference.flash_attention(qs, kvs, states, scale=scale, finalize=finalize)
        res = res if finalize else [State(*r) for r in res]
    elif impl == "jnp":
        res = _jnp_path(qs, kvs, states, scale, finalize)
    else:
        dtype = jnp.dtype(qs[0].dtype)
        on_gpu = jax.default_backend() == "gpu"
        if on_gpu and (d not in CUDA_HEAD_DIMS or dtype == jnp.float32):
            message = (f"flash_attention: no CUDA kernel for head_dim={d}, dtype={dtype.name} "
                       f"(supported: head_dim {CUDA_HEAD_DIMS}, float16/bfloat16)")
            if impl == "kernel":
                raise ValueError(message)
            _warn_once((d, dtype.name), message + "; using the jnp path")
            res = _jnp_path(qs, kvs, states, scale, finalize)
        else:
            res = _kernel_path(qs, kvs, states, scale, finalize, CUDA_KERNELS[cuda_kernel])
    return res[0] if single else res


def _hook(q, kv_chunks, state=None, *, scale=None):
    """The jax_cluster.parallel kernel hook: ``kernel(q, kv_chunks, state, *, scale) -> State``
    (or lists of query chunks and states -> a list of states)."""
    return flash_attention(q, kv_chunks, state, scale=scale)


_hook.takes_query_chunks = True  # Torus' several query chunks go in one launch, unconcatenated

la.register_kernel("flash_attention", _hook)
