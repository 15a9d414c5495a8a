"""The NVSHMEM transport of a schedule description (reached through ``nvshmem.execute``).

``xla_backend.run_local`` executes the schedule op by op, with :class:`PutTransport` moving
each :class:`~.description.Shift`:

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

import jax
import jax.numpy as jnp
import numpy as np

from . import xla_backend as xb
from .description import Schedule, Shift

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


class PutTransport:
    """Shifts as one-sided puts (the hooks of ``xla_backend.run_local``'s transport)."""

    def __init__(self, arena):
        self.arena = arena
        self.pending = []  # (dst slot, token, src) of this step, completed at its end

    def shift(self, schedule: Schedule, op: Shift, env: dict) -> None:
        lay = schedule.layout
        peers = [lay.shifted(r, op.axis, op.shift) for r in range(lay.num_devices)]
        tokens = []
        for s, d in zip(op.src, op.dst):
            tokens.append(_put(env[s], region=d, arena=self.arena, peers=peers))
            self.pending.append((d, tokens[-1], env[s]))
        # Issue the puts before the rest of the step: the step's attention reads values tied
        # to their tokens. Otherwise XLA may run that attention first, and the transfer would
        # start only when it ends.
        keys = list(env)
        _, tied = jax.lax.optimization_barrier((tokens, [env[x] for x in keys]))
        env.update(zip(keys, tied))

    def end_step(self, env: dict) -> None:
        for d, token, src in self.pending:
            env[d] = _wait(token, src, region=d, arena=self.arena)
        self.pending = []

    def finish(self, out):
        return _barrier(out, arena=self.arena)


def execute(schedule: Schedule, mesh, q, k, v, *, arena, kernel=None, scale=None):
    return xb.execute(schedule, mesh, q, k, v, kernel=kernel, scale=scale, transport=PutTransport(arena))
