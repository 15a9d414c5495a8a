"""The NVSHMEM executor of a schedule description (reached through ``nvshmem.execute``).

Like ``xla_backend.run_local``, op by op, except :class:`~.description.Shift`:

* at the Shift, ``jax_cluster_nvshmem_put`` (per destination slot): the source buffer is
  put into the peer's arena region of that slot with a signal, on the extension's side
  stream after the XLA stream's work so far (so the step's attention runs meanwhile);
* at the end of the step, ``jax_cluster_nvshmem_wait``: the XLA stream waits for the put it
  issued (keeping the source alive), a device kernel waits for this device's signal of the
  slot with the timeout (on expiry it records the fault and traps: an error, not a hang),
  resets it, and copies the region out into the slot's XLA buffer;
* after the output, ``jax_cluster_nvshmem_barrier`` (the output aliased through it): every
  PE signals every other and waits with the same timeout, so the next call's puts cannot
  land in a region still being copied out.

Peers are attributes: ``peers[pe]`` = the PE this Shift sends to from PE ``pe`` (PE = rank =
the device's index in the plan), so one program serves every process. The handlers carry
no command-buffer trait (the put/wait pairing lives on the host).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from . import local_attention as la
from . import xla_backend as xb
from .description import AllToAll, Attend, Finalize, JoinHeads, Schedule, Shift, SplitHeads

PUT, WAIT, BARRIER = "jax_cluster_nvshmem_put", "jax_cluster_nvshmem_wait", "jax_cluster_nvshmem_barrier"
_TOKEN = jax.ShapeDtypeStruct((1,), jnp.uint32)


def _put(x, *, region, arena, peers):
    offset, nbytes = arena.regions[region]
    return jax.ffi.ffi_call(PUT, _TOKEN, has_side_effect=True)(
        x, offset=np.int64(offset), nbytes=np.int64(nbytes), signal=np.int64(arena.signals[region]),
        signal_offset=np.int64(arena.signal_offset), peers=np.asarray(peers, np.int64))


def _wait(token, src, *, region, arena):
    offset, nbytes = arena.regions[region]
    out = jax.ShapeDtypeStruct(src.shape, src.dtype)
    return jax.ffi.ffi_call(WAIT, out, has_side_effect=True)(
        token, src, offset=np.int64(offset), nbytes=np.int64(nbytes), signal=np.int64(arena.signals[region]),
        signal_offset=np.int64(arena.signal_offset))


def _barrier(x, *, arena):
    return jax.ffi.ffi_call(BARRIER, jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True,
                            input_output_aliases={0: 0})(x, signal=np.int64(arena.barrier_signal),
                                                         signal_offset=np.int64(arena.signal_offset))


def run_local(schedule: Schedule, arena, q, k, v, *, kernel=None, scale=None):
    """One device's part of the schedule, Shifts as one-sided puts."""
    kernel = la.get_kernel(kernel)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    dtype = q.dtype
    env = {"q": q, "k": k, "v": v}
    states: dict = {}
    lay = schedule.layout
    for step in schedule.steps:
        pending = []  # (dst slot, token, src) completed at the end of the step
        for op in step.ops:
            if isinstance(op, Shift):
                n = lay.size(op.axis)
                if op.shift % n == 0:
                    for s, d in zip(op.src, op.dst):
                        env[d] = env[s]
                    continue
                peers = [lay.shifted(r, op.axis, op.shift) for r in range(lay.num_devices)]
                tokens = []
                for s, d in zip(op.src, op.dst):
                    tokens.append(_put(env[s], region=d, arena=arena, peers=peers))
                    pending.append((d, tokens[-1], env[s]))
                # Issue the puts before the rest of the step: the step's attention reads values
                # tied to their tokens. Otherwise XLA may run that attention first, and the
                # transfer would start only when it ends.
                keys = list(env)
                _, tied = jax.lax.optimization_barrier((tokens, [env[x] for x in keys]))
                env.update(zip(keys, tied))
            elif isinstance(op, AllToAll):
                g = xb._axis_size(schedule, op.axes)
                split, concat = (2, 1) if op.gather == "seq" else (1, 2)
                for s, d in zip(op.src, op.dst):
                    x = env[s]
                    env[d] = x if g == 1 else jax.lax.all_to_all(x, op.axes, split, concat, tiled=True)
            elif isinstance(op, SplitHeads):
                for d, x in zip(op.dst, xb._split_heads(env[op.src], len(op.dst), op.axis)):
                    env[d] = x
            elif isinstance(op, JoinHeads):
                env[op.dst] = xb._join_heads([env[s] for s in op.src], op.axis)
            elif isinstance(op, Attend):
                xb._attend(kernel, scale, env, states, op)
            elif isinstance(op, Finalize):
                for s, d in zip(op.src, op.dst):
                    st = states.get(s)
                    env[d] = jnp.zeros_like(env[s]) if st is None else la.finalize(st, dtype)
            else:  # pragma: no cover
                raise TypeError(f"unknown op {op!r}")
        for d, token, src in pending:
            env[d] = _wait(token, src, region=d, arena=arena)
    return _barrier(env[schedule.output], arena=arena)


def execute(schedule: Schedule, mesh, q, k, v, *, arena, kernel=None, scale=None):
    spec = PartitionSpec(None, tuple(schedule.layout.axis_names), None, None)
    body = functools.partial(run_local, schedule, arena, kernel=kernel, scale=scale)
    f = xb._shard_map(body, mesh, (spec, spec, spec), spec)
    return f(q, k, v)
