"""XLA backend: executes a :class:`~.schedules.Schedule` with ``jax.shard_map``,
``lax.all_to_all`` and ``lax.ppermute``.

Inputs and output are ``[B, L, H, Dh]`` arrays sharded along the sequence over all mesh axes
(device g holds block g). Each op of the description becomes one collective or one local
kernel call; overlap of a step's transfers with its attention is left to XLA's async
collectives and latency-hiding scheduler (see ``flags``).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from . import local_attention as la
from .description import AllToAll, Attend, Finalize, JoinHeads, Schedule, Shift, SplitHeads

def _shard_map(f, mesh, in_specs, out_specs):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _axis_size(schedule: Schedule, axes) -> int:
    return math.prod(schedule.layout.size(a) for a in axes)


def _coord(axis: str):
    return jax.lax.axis_index(axis)


def _split_heads(x, n, axis):
    b, l, h, d = x.shape
    x = x.reshape(b, l, n, h // n, d)
    if axis is not None:
        x = jnp.roll(x, -_coord(axis), axis=2)  # block j = (coord + j) mod n
    return [x[:, :, j] for j in range(n)]


def _join_heads(xs, axis):
    x = jnp.stack(xs, axis=2)
    if axis is not None:
        x = jnp.roll(x, _coord(axis), axis=2)
    b, l, n, h, d = x.shape
    return x.reshape(b, l, n * h, d)


def attend(kernel, scale, env, states, op: Attend):
    """Fold ``op``'s attention into ``states`` (one kernel call over its query and KV slots)."""
    if not op.kv:
        return
    kvs = [(env[k], env[v]) for k, v in op.kv]
    qs = [env[q] for q in op.q]
    sts = [states.get(q) for q in op.q]
    if len(qs) == 1:
        states[op.q[0]] = kernel(qs[0], kvs, sts[0], scale=scale)
        return
    if getattr(kernel, "takes_query_chunks", False):  # one launch over the chunks as they are
        for name, st in zip(op.q, kernel(qs, kvs, sts, scale=scale)):
            states[name] = st
        return
    # several query chunks share the KV: one launch over their concatenation
    b, _, h, d = qs[0].shape
    lens = [x.shape[1] for x in qs]
    out = kernel(jnp.concatenate(qs, 1), kvs, la.concat(sts, lens, h, d, b), scale=scale)
    for name, st in zip(op.q, la.split(out, lens)):
        states[name] = st


class PpermuteTransport:
    """How the XLA backend moves a :class:`Shift`'s slots: one ``ppermute`` per slot, which XLA's
    async collectives overlap with the step's attention. A transport has five hooks, called by
    :func:`run_local`: ``shift`` at the op, ``end_step`` after the step's ops (slots whose
    arrival is completed there), ``attend`` for an :class:`Attend` (a transport whose slots
    are not arrays may read them in place), ``read`` before any other op reads slots (they
    must be arrays then), ``finish`` on the output."""

    def shift(self, schedule: Schedule, op: Shift, env: dict) -> None:
        n = schedule.layout.size(op.axis)
        perm = [(i, (i + op.shift) % n) for i in range(n)]
        for s, d in zip(op.src, op.dst):
            env[d] = jax.lax.ppermute(env[s], op.axis, perm)

    def end_step(self, env: dict) -> None:
        pass

    def attend(self, kernel, scale, env: dict, states: dict, op: Attend) -> None:
        attend(kernel, scale, env, states, op)

    def read(self, env: dict, names) -> None:
        pass

    def finish(self, out):
        return out


def _reads(op, states) -> tuple[str, ...]:
    """The slots an op other than Shift and Attend reads from ``env``."""
    if isinstance(op, (AllToAll, JoinHeads)):
        return tuple(op.src)
    if isinstance(op, SplitHeads):
        return (op.src,)
    if isinstance(op, Finalize):  # a slot with a state is read through it
        return tuple(s for s in op.src if s not in states)
    raise TypeError(f"unknown op {op!r}")


def run_local(schedule: Schedule, q, k, v, *, kernel=None, scale=None, transport=None):
    """Body of the shard_map: one device's part of the schedule on its local blocks, its
    Shifts through ``transport`` (default: :class:`PpermuteTransport`)."""
    kernel = la.get_kernel(kernel)
    transport = PpermuteTransport() if transport is None else transport
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    dtype = q.dtype
    env = {"q": q, "k": k, "v": v}
    states: dict[str, la.State] = {}
    lay = schedule.layout
    for step in schedule.steps:
        for op in step.ops:
            if not isinstance(op, (Shift, Attend)):
                transport.read(env, _reads(op, states))
            if isinstance(op, AllToAll):
                g = _axis_size(schedule, op.axes)
                split, concat = (2, 1) if op.gather == "seq" else (1, 2)
                for s, d in zip(op.src, op.dst):
                    x = env[s]
                    env[d] = x if g == 1 else jax.lax.all_to_all(x, op.axes, split, concat, tiled=True)
            elif isinstance(op, Shift):
                if op.shift % lay.size(op.axis) == 0:  # a shift onto itself moves nothing
                    for s, d in zip(op.src, op.dst):
                        env[d] = env[s]
                else:
                    transport.shift(schedule, op, env)
            elif isinstance(op, SplitHeads):
                for d, x in zip(op.dst, _split_heads(env[op.src], len(op.dst), op.axis)):
                    env[d] = x
            elif isinstance(op, JoinHeads):
                env[op.dst] = _join_heads([env[s] for s in op.src], op.axis)
            elif isinstance(op, Attend):
                if op.kv:
                    transport.attend(kernel, scale, env, states, op)
            elif isinstance(op, Finalize):
                for s, d in zip(op.src, op.dst):
                    st = states.get(s)
                    env[d] = jnp.zeros_like(env[s]) if st is None else la.finalize(st, dtype)
            else:  # pragma: no cover
                raise TypeError(f"unknown op {op!r}")
        transport.end_step(env)
    transport.read(env, (schedule.output,))
    return transport.finish(env[schedule.output])


def execute(schedule: Schedule, mesh, q, k, v, *, kernel=None, scale=None, transport=None):
    """Run ``schedule`` on ``mesh`` (axes named as in the schedule's layout) over global
    ``[B, L, H, Dh]`` arrays; the result is sharded along the sequence like the inputs.
    ``transport``: how Shifts move data (default: ``ppermute``; the NVSHMEM backend's puts)."""
    spec = PartitionSpec(None, tuple(schedule.layout.axis_names), None, None)
    body = functools.partial(run_local, schedule, kernel=kernel, scale=scale, transport=transport)
    f = _shard_map(body, mesh, (spec, spec, spec), spec)
    return f(q, k, v)
