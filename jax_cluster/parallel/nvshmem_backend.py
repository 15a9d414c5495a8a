"""The NVSHMEM transport of a schedule description (reached through ``nvshmem.execute``).

``xla_backend.run_local`` executes the schedule op by op, with :class:`PutTransport` moving
each :class:`~.description.Shift`:

* at the Shift, ``jax_cluster_nvshmem_put`` (per destination slot): the source is put into
  the peer's arena region of that slot with a signal, on the extension's side stream after
  the XLA stream's work so far (so the step's attention runs meanwhile);
* at the end of the step, ``jax_cluster_nvshmem_wait``: the XLA stream waits for the put it
  issued (keeping the source alive), and a device kernel waits for this device's signal of
  the slot with the timeout (on expiry it records the fault and traps: an error, not a
  hang) and resets it. The slot is now an :class:`ArenaSlot`: its bytes stay in the arena;
* what reads an arrived slot reads it IN PLACE where it can: the step's attention
  (``jax_cluster_nvshmem_flash_attention``: the op ``flash_attention``'s kernel with those
  chunks' rows in the arena) and a later Shift (the ring passing K/V on: a put from the
  arena). Anything else (a head split, the output's join, another attention kernel) gets a
  copy (``jax_cluster_nvshmem_read``);
* after the output, ``jax_cluster_nvshmem_barrier`` (the output aliased through it): every
  PE signals every other and waits with the same timeout, so the next call's puts cannot
  land in a region still being read.

Peers are attributes: ``peers[pe]`` = the PE this Shift sends to from PE ``pe`` (PE = rank =
the device's index in the plan), so one program serves every process. The handlers carry
no command-buffer trait (the put/wait pairing lives on the host).

``$JAX_CLUSTER_NVSHMEM_COPY_OUT=1`` (read when a call is traced) copies every arrived slot
out at its wait instead, the transport before in-place reads: a measurement knob.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_cluster.ops import flash_attention as fa

from . import local_attention as la
from . import xla_backend as xb
from .description import Attend, Schedule, Shift

PUT, WAIT, READ, BARRIER = ("jax_cluster_nvshmem_put", "jax_cluster_nvshmem_wait", "jax_cluster_nvshmem_read",
                            "jax_cluster_nvshmem_barrier")
ATTEND = "jax_cluster_nvshmem_flash_attention"
COPY_OUT_ENV = "JAX_CLUSTER_NVSHMEM_COPY_OUT"
_TOKEN = jax.ShapeDtypeStruct((1,), jnp.uint32)
_DTYPE_CODE = {jnp.dtype(jnp.float16): 0, jnp.dtype(jnp.bfloat16): 1}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ArenaSlot:
    """A slot that arrived by a put and stays in this device's arena region ``region``;
    ``token`` is its wait's result: whatever reads the region takes it as an operand, so XLA
    orders the read after the wait."""

    token: jax.Array
    region: str = dataclasses.field(metadata={"static": True})
    shape: tuple = dataclasses.field(metadata={"static": True})
    dtype: object = dataclasses.field(metadata={"static": True})


# ------------------------------------------------------------------------ the FFI calls
def _put(x, *, region, arena, peers):
    """Put ``x`` (an array, or an arrived :class:`ArenaSlot` forwarded from the arena) into
    the peer's region ``region``; returns the put's token."""
    offset, nbytes = arena.regions[region]
    if isinstance(x, ArenaSlot):
        operand, src_offset = x.token, arena.regions[x.region][0]
    else:
        operand, src_offset = x, -1
    return jax.ffi.ffi_call(PUT, _TOKEN, has_side_effect=True)(
        operand, offset=np.int64(offset), nbytes=np.int64(nbytes), signal=np.int64(arena.signals[region]),
        signal_offset=np.int64(arena.signal_offset), peers=np.asarray(peers, np.int64),
        src_offset=np.int64(src_offset))


def _wait(token, keep, *, region, arena):
    """Wait for region ``region``'s put (``token``; ``keep``: its source, kept alive until
    the put is done) and its signal; returns the arrival's token."""
    return jax.ffi.ffi_call(WAIT, _TOKEN, has_side_effect=True)(
        token, keep, signal=np.int64(arena.signals[region]), signal_offset=np.int64(arena.signal_offset))


def _read(slot: ArenaSlot, *, arena):
    """A copy of an arrived slot, as an array."""
    out = jax.ShapeDtypeStruct(slot.shape, slot.dtype)
    return jax.ffi.ffi_call(READ, out)(slot.token, offset=np.int64(arena.regions[slot.region][0]))


def _barrier(x, *, arena):
    return jax.ffi.ffi_call(BARRIER, jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True,
                            input_output_aliases={0: 0})(x, signal=np.int64(arena.barrier_signal),
                                                         signal_offset=np.int64(arena.signal_offset))


def _arena_flash_attention(qs, kvs, states, scale, *, arena):
    """``flash_attention(qs, kvs, states)`` (one launch) where any q, k or v chunk may be an
    :class:`ArenaSlot`, read in place; returns one fp32 State per query chunk."""
    chunks = list(qs) + [k for k, _ in kvs] + [v for _, v in kvs]
    offsets = [arena.regions[c.region][0] if isinstance(c, ArenaSlot) else -1 for c in chunks]
    operands = [c.token if isinstance(c, ArenaSlot) else c for c in chunks]
    mask = 0
    for i, st in enumerate(states):
        if st is not None:
            mask |= 1 << i
            operands += [st.o, st.lse]
    b, _, h, d = qs[0].shape
    outs = []
    for q in qs:
        outs += [jax.ShapeDtypeStruct((b, q.shape[1], h, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, q.shape[1]), jnp.float32)]
    res = jax.ffi.ffi_call(ATTEND, outs)(
        *operands, num_q=np.int64(len(qs)), num_kv=np.int64(len(kvs)), state_mask=np.int64(mask),
        scale=np.float32(scale), finalize=False, kernel=np.int64(0), arena=np.asarray(offsets, np.int64),
        rows=np.asarray([c.shape[1] for c in chunks], np.int64), batch=np.int64(b), heads=np.int64(h),
        head_dim=np.int64(d), dtype=np.int64(_DTYPE_CODE[jnp.dtype(qs[0].dtype)]))
    return [la.State(o, lse) for o, lse in zip(res[0::2], res[1::2])]


# ------------------------------------------------------------------------ the transport
class PutTransport:
    """Shifts as one-sided puts, arrived slots read in place (the hooks of
    ``xla_backend.run_local``'s transport)."""

    def __init__(self, arena, *, copy_out: bool | None = None):
        self.arena = arena
        self.copy_out = os.environ.get(COPY_OUT_ENV, "0") == "1" if copy_out is None else copy_out
        self.pending = []  # (dst slot, token, what keeps the source alive, shape, dtype) of this step

    def shift(self, schedule: Schedule, op: Shift, env: dict) -> None:
        lay = schedule.layout
        peers = [lay.shifted(r, op.axis, op.shift) for r in range(lay.num_devices)]
        tokens = []
        for s, d in zip(op.src, op.dst):
            x = env[s]
            tokens.append(self._put(x, d, peers))
            keep = x.token if isinstance(x, ArenaSlot) else x
            self.pending.append((d, tokens[-1], keep, x.shape, x.dtype))
        # Issue the puts before the rest of the step: the step's attention reads values tied
        # to their tokens. Otherwise XLA may run that attention first, and the transfer would
        # start only when it ends.
        keys = list(env)
        _, tied = jax.lax.optimization_barrier((tokens, [env[x] for x in keys]))
        env.update(zip(keys, tied))

    def end_step(self, env: dict) -> None:
        for d, token, keep, shape, dtype in self.pending:
            env[d] = ArenaSlot(self._wait(token, keep, d), d, tuple(shape), jnp.dtype(dtype))
            if self.copy_out:
                env[d] = self._read(env[d])
        self.pending = []

    def attend(self, kernel, scale, env: dict, states: dict, op: Attend) -> None:
        names = op.q + tuple(x for kv in op.kv for x in kv)
        if any(isinstance(env[n], ArenaSlot) for n in names) and self._in_place(kernel, env, op):
            qs = [env[q] for q in op.q]
            kvs = [(env[k], env[v]) for k, v in op.kv]
            for name, st in zip(op.q, self._attention(qs, kvs, [states.get(q) for q in op.q], scale)):
                states[name] = st
            return
        self.read(env, names)
        xb.attend(kernel, scale, env, states, op)

    def read(self, env: dict, names) -> None:
        for n in names:
            if isinstance(env[n], ArenaSlot):
                env[n] = self._read(env[n])

    def finish(self, out):
        return self._barrier(out)

    def _in_place(self, kernel, env, op: Attend) -> bool:
        """Whether the op's attention can read the arena: the flash_attention kernel, a shape
        and dtype it has a CUDA kernel for, chunks that fit one launch."""
        q0 = env[op.q[0]]
        return (la.get_kernel(kernel) is la.flash_attention_kernel and len(op.q) <= fa.MAX_Q_CHUNKS
                and len(op.kv) <= fa.MAX_KV_CHUNKS and jnp.dtype(q0.dtype) in _DTYPE_CODE
                and fa.cuda_supported(q0.shape[3], q0.dtype))

    # The device primitives, methods so that a test can stand in for the device.
    def _put(self, x, region, peers):
        return _put(x, region=region, arena=self.arena, peers=peers)

    def _wait(self, token, keep, region):
        return _wait(token, keep, region=region, arena=self.arena)

    def _read(self, slot: ArenaSlot):
        return _read(slot, arena=self.arena)

    def _attention(self, qs, kvs, states, scale):
        return _arena_flash_attention(qs, kvs, states, scale, arena=self.arena)

    def _barrier(self, out):
        return _barrier(out, arena=self.arena)


def execute(schedule: Schedule, mesh, q, k, v, *, arena, kernel=None, scale=None, transport=None):
    transport = PutTransport(arena) if transport is None else transport
    return xb.execute(schedule, mesh, q, k, v, kernel=kernel, scale=scale, transport=transport)
