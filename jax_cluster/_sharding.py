"""Row partitioning of the decode ops over a device mesh.

A decode op's rows (the batch: x's rows, their caches and lengths) are independent of each
other and every row reads the same weights. So when its row operands are sharded over mesh
axes under ``jit``, each device can run the op on its own rows with the weights replicated,
and nothing needs gathering. Without a rule XLA sees an opaque custom call and gathers every
operand to every device (the KV caches included) and replicates the results.

:func:`row_partitioned` wraps an op's core (the function that binds its primitive):
- rows typed as sharded over Explicit mesh axes (known at trace time): ``jax.shard_map``
  over those axes, the core on each device's rows, the results typed row-sharded;
- otherwise ``jax.experimental.custom_partitioning`` with a Shardy rule: dimension 0 of
  every row operand and row result is one factor, every other dimension must be
  replicated. The partitioner then calls the core on each device's rows where it finds
  them sharded (Auto axes). On one device the core is inlined as it was. Under ``vmap`` the
  core runs unpartitioned (custom_partitioning has no batching rule; the primitive's own
  folds the mapped axis into the rows).

``JAX_CLUSTER_ROW_PARTITIONING=0`` turns the wrapper off (read at trace time): the partitioner's
callback is Python, so ``jax.export`` cannot serialize a multi-device program on Auto axes
that holds it.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import jax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec

_ROW = "rows"
ENV_ENABLE = "JAX_CLUSTER_ROW_PARTITIONING"


def enabled() -> bool:
    return os.environ.get(ENV_ENABLE, "1").strip().lower() not in ("0", "false", "off", "no")


def _rule(row_in: Sequence[bool], row_out: Sequence[bool], in_ranks, out_ranks) -> tuple[str, tuple[str, ...]]:
    """'rows a0, b0 b1, ... -> rows c0, ...' and the factors that must stay replicated."""
    names: list[str] = []

    def mapping(is_row: bool, rank: int) -> str:
        dims = []
        for d in range(rank):
            if d == 0 and is_row:
                dims.append(_ROW)
            else:
                names.append(f"f{len(names)}")
                dims.append(names[-1])
        return " ".join(dims)

    ins = ", ".join(mapping(r, n) for r, n in zip(row_in, in_ranks))
    outs = ", ".join(mapping(r, n) for r, n in zip(row_out, out_ranks))
    return f"{ins} -> {outs}", tuple(names)


def _rows_sharding(shardings, ndims, flags):
    """The sharding of the first row operand whose dimension 0 is sharded (None: none is)."""
    for sharding, ndim, is_row in zip(shardings, ndims, flags):
        if is_row and ndim and isinstance(sharding, NamedSharding) and len(sharding.spec) and sharding.spec[0]:
            return sharding
    return None


def _row_spec(axes, is_row: bool, ndim: int) -> PartitionSpec:
    return PartitionSpec(axes) if is_row and ndim else PartitionSpec()


def _explicit_row_axes(leaves, flags):
    """The Explicit mesh axes the row operands' dimension 0 is typed as sharded over, with
    their mesh; (None, None) where the types say nothing (Auto axes, one device)."""
    sharding = _rows_sharding([jax.typeof(leaf).sharding for leaf in leaves], [leaf.ndim for leaf in leaves], flags)
    if sharding is None:
        return None, None
    axes = sharding.spec[0] if isinstance(sharding.spec[0], tuple) else (sharding.spec[0],)
    kinds = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
    if not all(kinds[a] == AxisType.Explicit for a in axes):
        return None, None
    return sharding.spec[0], sharding.mesh


def row_partitioned(core: Callable, row_in: Sequence[bool], row_out: Sequence[bool]) -> Callable:
    """core(*args) -> tuple of arrays; args are arrays or pytrees of them (dicts, None).

    row_in[i]: whether every array of argument i has the rows as its dimension 0;
    row_out[j]: the same of result j. Returns a function of the same arguments that runs
    core on each device's rows where the row operands are sharded over mesh axes.
    """
    row_in, row_out = tuple(row_in), tuple(row_out)

    def partitioned(*args):
        if not enabled():
            return tuple(core(*args))
        leaves, tree = jax.tree.flatten(args)
        flags = tuple(flag for arg, flag in zip(args, row_in) for _ in jax.tree.leaves(arg))

        def call(*ops):
            return tuple(core(*jax.tree.unflatten(tree, ops)))

        axes, mesh = _explicit_row_axes(leaves, flags)
        if axes is not None:
            return jax.shard_map(call, mesh=mesh,
                                 in_specs=tuple(_row_spec(axes, f, leaf.ndim) for f, leaf in zip(flags, leaves)),
                                 out_specs=tuple(_row_spec(axes, f, 1) for f in row_out), check_vma=False)(*leaves)

        @custom_partitioning
        def op(*ops):
            return call(*ops)

        def partition(mesh, arg_shapes, result_shape):
            rows = _rows_sharding([s.sharding for s in arg_shapes], [s.ndim for s in arg_shapes], flags)
            axes = None if rows is None else rows.spec[0]

            def sharding(shape, is_row):
                return NamedSharding(mesh, _row_spec(axes, is_row, shape.ndim))

            return (mesh, call, tuple(map(sharding, result_shape, row_out)),
                    tuple(map(sharding, arg_shapes, flags)))

        def sharding_rule(mesh, value_types, result_types):
            rule, names = _rule(flags, row_out, [len(v.shape) for v in value_types],
                                [len(r.shape) for r in result_types])
            return rule, {"need_replication_factors": names}

        op.def_partition(partition=partition, sharding_rule=sharding_rule)

        @custom_vmap
        def mapped(*ops):
            return op(*ops)

        @mapped.def_vmap
        def _vmap(axis_size, in_batched, *ops):
            outs = jax.vmap(call, in_axes=tuple(0 if b else None for b in in_batched), axis_size=axis_size)(*ops)
            return outs, (True,) * len(outs)

        return mapped(*leaves)

    return partitioned
