"""The one pattern every op follows: an FFI-backed JAX primitive.

An op module supplies an abstract-eval rule (shape/dtype checks with clear
errors happen in the public wrapper before bind) and a batching rule; this
helper wires the per-platform lowerings to the FFI target
`jax_cluster_<name>` registered by the CPU and CUDA modules.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_cluster import _extension

try:  # jax's own eager path for primitives (used by every FFI extension)
    from jax._src.dispatch import apply_primitive as _apply_primitive
except ImportError:  # pragma: no cover - future jax moved it
    _apply_primitive = None


def _eager_impl(prim: Primitive):
    if _apply_primitive is not None:
        return lambda *args, **params: _apply_primitive(prim, *args, **params)
    return lambda *args, **params: jax.jit(lambda *a: prim.bind(*a, **params))(*args)


def ffi_primitive(
    name: str,
    *,
    abstract_eval: Callable,
    batching_rule: Callable | None = None,
    operand_output_aliases: dict[int, int] | None = None,
    platforms: Sequence[str] = ("cpu", "cuda"),
) -> Primitive:
    """Defines primitive `jax_cluster_<name>` lowered to the FFI target of that name.

    Primitive params become FFI attributes (ints -> int64, bools -> pred).
    """
    target = f"jax_cluster_{name}"
    prim = Primitive(target)
    prim.multiple_results = True
    prim.def_impl(_eager_impl(prim))
    prim.def_abstract_eval(abstract_eval)
    lowering = jax.ffi.ffi_lowering(target, operand_output_aliases=operand_output_aliases)

    def lower_cpu(ctx, *args, **params):
        _extension.register_targets()
        return lowering(ctx, *args, **params)

    def lower_cuda(ctx, *args, **params):
        _extension.require_cuda_target(target)
        return lowering(ctx, *args, **params)

    rules = {"cpu": lower_cpu, "cuda": lower_cuda}
    for platform in platforms:
        mlir.register_lowering(prim, rules[platform], platform=platform)
    if batching_rule is not None:
        batching.primitive_batchers[prim] = batching_rule
    return prim


def fold_batch_axis(x: jax.Array, axis: int | None, size: int) -> jax.Array:
    """Moves a vmapped axis to the front (broadcasting unbatched operands)."""
    if axis is None:
        return jax.numpy.broadcast_to(x, (size,) + x.shape)
    return jax.numpy.moveaxis(x, axis, 0)
