"""flash_attention: non-causal attention of several query chunks over several KV chunks in
ONE launch, folded into a running (o, lse) state per query chunk (StreamFusion App. C,
Algorithm 2: the local kernel of the Ring / Torus schedules in jax_cluster.parallel).

    for each query chunk i:  s = scale * q_i k^T   over the keys of EVERY kv chunk
                             new = (softmax(s) v, logsumexp(s))
                             state_i = merge(state_i, new)     (log-sum-exp / sigmoid form)

q chunks [B, Lq_i, H, Dh] and kv chunks (k, v) [B, Lk_j, H, Dh] may have different lengths
(0 included) but share B, H, Dh and the dtype. A state is
:class:`~jax_cluster.ops.attention_state.State` ``(o, lse)``: o fp32 [B, Lq, H, Dh]
NORMALIZED (softmax-weighted mean of V over the keys seen), lse fp32 [B, H, Lq] natural log;
lse = -inf is an empty row (its o is ignored); ``None`` = empty.

impl (the contract of every op, jax_cluster._ffi):
  "auto"       the custom call where a CUDA kernel covers the call (Dh 64 / 128, fp16 / bf16
               on a GPU; anything on CPU, where the C++ handler runs); other shapes on a GPU
               run "xla" with a one-time warning
  "cuda"       the custom call; a shape without a CUDA kernel on a GPU is an error
  "xla"        :func:`attend`: the same blocked online-softmax formulation in XLA's ops
               (bounded memory for long sequences)
  "reference"  jax_cluster.reference.flash_attention (dense, fp32)

On a Hopper GPU the custom call is one launch over every (query tile, head, batch): by
default the FlashAttention-3 style kernel (TMA into an mbarrier ring fed by a producer warp,
wgmma on two consumer warpgroups with setmaxnreg, the softmax overlapped with the GEMMs,
ping-pong between the warpgroups); the mma.sync m16n8k16 kernel (FlashAttention-2 style,
cp.async double buffering) serves what the first does not (a negative scale).
:class:`FlashAttentionConfig` picks one of the two. The chunks' tensor maps and pointers
are kernel parameters: no concatenation up to 32 query and 32 KV chunks per launch (the
wrapper concatenates beyond). docs/flash_attention.md has the design and measurements.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jax_cluster import _extension, reference
from jax_cluster._ffi import check_config, check_impl, ffi_primitive, fold_batch_axis, on_gpu, warn_once
from jax_cluster.ops.attention_state import State, concat, empty_state, finalize, merge, split

__all__ = ["FlashAttentionConfig", "attend", "flash_attention"]

_PLAN = _extension.plans()
MAX_Q_CHUNKS, MAX_KV_CHUNKS = _PLAN.flash_attention_max_chunks()
CUDA_KERNELS = ("wgmma", "mma")
_KERNEL_ATTR = {None: 0, "wgmma": 1, "mma": 2}  # FlashKernel (cpp/ops/flash_attention/params.h)
_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig:
    """Which CUDA kernel runs the call (``config=None``: the wgmma kernel where it serves the
    call, else the mma.sync one).

    kernel  "wgmma": the Hopper wgmma/TMA kernel (it needs scale >= 0: an error otherwise);
            "mma": the mma.sync kernel (any scale)
    """

    kernel: str = "wgmma"

    def __post_init__(self):
        if self.kernel not in CUDA_KERNELS:
            raise ValueError(f"FlashAttentionConfig: kernel must be one of {CUDA_KERNELS}, "
                             f"got {self.kernel!r}")


def cuda_supported(head_dim: int, dtype) -> bool:
    """Whether a CUDA kernel covers this head dim and dtype (the C++ rule, read once)."""
    return bool(_PLAN.flash_attention_cuda_supports(int(head_dim), jnp.dtype(dtype).name))


# ---------------------------------------------------------------- the XLA formulation
# Blocking: bounded memory for long sequences (scores are [B, H, q_block, kv_block]).
Q_BLOCK = 2048
KV_BLOCK = 2048


def _block_state(q, k, v, scale) -> State:
    """State of one query block against one KV block (Lk > 0), fp32 accumulation."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
    o = o / jnp.transpose(l, (0, 2, 1))[..., None]
    return State(o, m + jnp.log(l))


def _kv_fold(q, k, v, state: State, scale, kv_block: int) -> State:
    """Fold one KV chunk into ``state``, scanning over KV blocks of ``kv_block`` tokens."""
    lk = k.shape[1]
    if lk <= kv_block:
        return merge(state, _block_state(q, k, v, scale))
    nb, rem = divmod(lk, kv_block)
    main = nb * kv_block
    kb = k[:, :main].reshape(k.shape[0], nb, kv_block, *k.shape[2:]).swapaxes(0, 1)
    vb = v[:, :main].reshape(v.shape[0], nb, kv_block, *v.shape[2:]).swapaxes(0, 1)

    def body(st, kv):
        return merge(st, _block_state(q, kv[0], kv[1], scale)), None

    state, _ = jax.lax.scan(body, state, (kb, vb))
    if rem:
        state = merge(state, _block_state(q, k[:, main:], v[:, main:], scale))
    return state


def _attend_qblock(q, kv_chunks, state: State, scale, kv_block) -> State:
    for k, v in kv_chunks:
        if k.shape[1]:
            state = _kv_fold(q, k, v, state, scale, kv_block)
    return state


def attend(
    q: jax.Array,
    kv_chunks: Sequence[tuple[jax.Array, jax.Array]],
    state: State | None = None,
    *,
    scale: float | None = None,
    q_block: int = Q_BLOCK,
    kv_block: int = KV_BLOCK,
) -> State:
    """``flash_attention(q, kv_chunks, state, impl="xla")`` for one query chunk: the online
    softmax in XLA's ops, tiled ``q_block`` x ``kv_block`` so the scores never exceed
    ``B * H * q_block * kv_block`` floats. Non-causal; empty chunks are skipped;
    ``state=None`` is the empty state. Returns the merged fp32 :class:`State`."""
    b, lq, h, d = q.shape
    for i, (k, v) in enumerate(kv_chunks):
        if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (h, d):
            raise ValueError(
                f"kv_chunks[{i}]: k {k.shape} and v {v.shape} must both be [B={b}, Lk, H={h}, Dh={d}]"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if state is None:
        state = empty_state(b, lq, h, d)
    if state.o.shape != (b, lq, h, d) or state.lse.shape != (b, h, lq):
        raise ValueError(
            f"state: o {state.o.shape} / lse {state.lse.shape} must be "
            f"[{b}, {lq}, {h}, {d}] / [{b}, {h}, {lq}]"
        )
    state = State(state.o.astype(jnp.float32), state.lse.astype(jnp.float32))
    if lq == 0 or not any(k.shape[1] for k, _ in kv_chunks):
        return state
    if lq <= q_block:
        return _attend_qblock(q, kv_chunks, state, scale, kv_block)
    nb, rem = divmod(lq, q_block)
    main = nb * q_block

    def qblocks(x, axis):  # [.., main, ..] -> [nb, .., q_block, ..]
        x = jax.lax.slice_in_dim(x, 0, main, axis=axis)
        shp = x.shape[:axis] + (nb, q_block) + x.shape[axis + 1 :]
        return jnp.moveaxis(x.reshape(shp), axis, 0)

    def one(args):
        qq, oo, ll = args
        st = _attend_qblock(qq, kv_chunks, State(oo, ll), scale, kv_block)
        return st.o, st.lse

    ob, lb = jax.lax.map(one, (qblocks(q, 1), qblocks(state.o, 1), qblocks(state.lse, 2)))
    o = jnp.moveaxis(ob, 0, 1).reshape(b, main, h, d)
    lse = jnp.moveaxis(lb, 0, 2).reshape(b, h, main)
    if rem:
        tail = _attend_qblock(
            q[:, main:], kv_chunks, State(state.o[:, main:], state.lse[..., main:]), scale, kv_block
        )
        o = jnp.concatenate([o, tail.o], axis=1)
        lse = jnp.concatenate([lse, tail.lse], axis=2)
    return State(o, lse)


# ---------------------------------------------------------------- the custom call
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
        a = fold_batch_axis(a, d, size)
        folded.append(a.reshape((size * a.shape[1],) + a.shape[2:]))
    outs = _PRIM.bind(*folded, **params)
    return [o.reshape((size, o.shape[0] // size) + o.shape[1:]) for o in outs], [0] * len(outs)


_PRIM = ffi_primitive("flash_attention", abstract_eval=_abstract, batching_rule=_batching)


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
        out.append(State(jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32)))
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


def _xla_path(qs, kvs, states, scale, do_finalize):
    out = []
    for q, st in zip(qs, states):
        s = attend(q, kvs, st, scale=scale)
        out.append(finalize(s, q.dtype) if do_finalize else s)
    return out


def _cuda_path(qs, kvs, states, scale, do_finalize, kernel):
    # More chunks than one launch takes: concatenate (a copy, but still one launch).
    if len(qs) > MAX_Q_CHUNKS:
        b, _, h, d = qs[0].shape
        lens = [q.shape[1] for q in qs]
        st = concat(states, lens, h, d, b)
        (res,) = _cuda_path([jnp.concatenate(qs, 1)], kvs, [st], scale, do_finalize, kernel)
        if do_finalize:
            cuts = np.cumsum([0] + lens)
            return [res[:, a:c] for a, c in zip(cuts[:-1], cuts[1:])]
        return split(res, lens)
    if len(kvs) > MAX_KV_CHUNKS:
        kvs = [(jnp.concatenate([k for k, _ in kvs], 1), jnp.concatenate([v for _, v in kvs], 1))]
    mask = sum(1 << i for i, st in enumerate(states) if st is not None)
    operands = list(qs) + [k for k, _ in kvs] + [v for _, v in kvs]
    for st in states:
        if st is not None:
            operands += [st.o, st.lse]
    outs = _PRIM.bind(*operands, num_q=len(qs), num_kv=len(kvs), state_mask=int(mask),
                      scale=np.float32(scale), finalize=bool(do_finalize), kernel=kernel)
    if do_finalize:
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
    config: FlashAttentionConfig | None = None,
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
    impl       "auto", "cuda", "xla" or "reference" (see the module docstring)
    config     :class:`FlashAttentionConfig` (the CUDA kernel), or None (the wgmma kernel
               where it serves the call, else the mma.sync one)
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
    check_impl("flash_attention", impl)
    check_config("flash_attention", config, FlashAttentionConfig)

    if impl == "reference":
        res = reference.flash_attention(qs, kvs, states, scale=scale, finalize=finalize)
        res = res if finalize else [State(*r) for r in res]
    elif impl == "xla":
        res = _xla_path(qs, kvs, states, scale, finalize)
    else:
        dtype = jnp.dtype(qs[0].dtype)
        if on_gpu() and not cuda_supported(d, dtype):
            message = (f"flash_attention: no CUDA kernel for head_dim={d}, dtype={dtype.name} "
                       f"(supported: head_dim 64 or 128, float16/bfloat16)")
            if impl == "cuda":
                raise ValueError(message)
            warn_once(("flash_attention", d, dtype.name), message + "; using impl='xla'")
            res = _xla_path(qs, kvs, states, scale, finalize)
        else:
            kernel = _KERNEL_ATTR[None if config is None else config.kernel]
            res = _cuda_path(qs, kvs, states, scale, finalize, kernel)
    return res[0] if single else res
