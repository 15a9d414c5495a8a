"""What every op module shares: the FFI-backed primitive, the `impl` contract, checks.

Public JAX only (jax.ffi, jax.extend, jax.interpreters): nothing here reaches into JAX's
private modules, so a JAX release that moves internals cannot break the ops.

An op module defines an abstract-eval rule and a batching rule, calls
:func:`ffi_primitive` once, and binds the primitive from its public function after
validating the arguments (clear errors at trace time, before any kernel runs).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_cluster import _extension

# The one meaning of `impl` in every op:
#   "auto"      the tuner's pick among what can run here (a CUDA config or "xla"); shapes the
#               kernels do not cover run "xla" with a one-time warning
#   "cuda"      the jax_cluster custom call: the CUDA kernel on a GPU, the plain C++ handler on
#               CPU (same math, so the FFI path is tested without a GPU); an unsupported shape
#               is an error
#   "xla"       the plain formulation a JAX user writes (XLA's ops in the input dtype)
#   "reference" the jnp reference of jax_cluster.reference (fp32 math)
IMPLS = ("auto", "cuda", "xla", "reference")


def check_impl(op: str, impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")


def check_config(op: str, config, config_type: type) -> None:
    if config is not None and not isinstance(config, config_type):
        article = "an" if config_type.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"{op}: config must be {article} {config_type.__name__} or None, got {config!r}")


def check_call(op: str, impl: str, config, config_type: type) -> None:
    """impl and config of a call: a known impl, a config of the op's type or None, and no
    config with impl "xla" / "reference" (they launch nothing a config could choose)."""
    check_impl(op, impl)
    check_config(op, config, config_type)
    if config is not None and impl in ("xla", "reference"):
        raise ValueError(f"{op}: a config applies to impl='auto' or 'cuda', not {impl!r}")


def check_eps(op: str, name: str, eps) -> None:
    """A norm's epsilon: a concrete finite number >= 0 (a negative one makes the norm NaN on
    small rows; the kernels take it as a launch constant, so it cannot be traced)."""
    try:
        value = None if isinstance(eps, (bool, str, bytes)) else float(eps)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
        value = None
    if value is None or not math.isfinite(value) or value < 0:
        raise ValueError(f"{op}: {name} must be a finite number >= 0, got {eps!r}")


def check_array(op: str, name: str, array, shape, dtype=None) -> None:
    """ValueError naming the argument when `array` (skipped if None) has another shape/dtype."""
    if array is None:
        return
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} has shape {tuple(array.shape)}, expected {tuple(shape)}")
    if dtype is not None and jnp.dtype(array.dtype) != jnp.dtype(dtype):
        raise ValueError(f"{op}: {name} has dtype {jnp.dtype(array.dtype).name}, "
                         f"expected {jnp.dtype(dtype).name}")


_warned: set = set()


def warn_once(key, message: str, stacklevel: int = 3) -> None:
    """A warning shown once per process for each key (fallbacks warn once, not per call)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=stacklevel)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def num_sms(default: int = 132) -> int:
    """Streaming multiprocessors of the default GPU (the H100's count off the GPU)."""
    if not on_gpu():
        return default
    return int(getattr(jax.devices()[0], "core_count", default))


def _eager_impl(prim: Primitive) -> Callable:
    """Outside jit a primitive runs as a one-op jitted program, compiled once per params."""

    @functools.lru_cache(maxsize=None)
    def compiled(params: tuple):
        kwargs = dict(params)
        return jax.jit(lambda *args: prim.bind(*args, **kwargs))

    return lambda *args, **params: compiled(tuple(sorted(params.items())))(*args)


def ffi_primitive(
    name: str,
    *,
    abstract_eval: Callable,
    batching_rule: Callable | None = None,
    operand_output_aliases: dict[int, int] | None = None,
) -> Primitive:
    """Primitive `jax_cluster_<name>` lowered to the FFI target of that name on CPU and CUDA.

    Primitive params become FFI attributes (Python ints -> int64, bools -> pred,
    np.float32 -> f32). Every result is an output of the custom call (multiple_results).
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

    mlir.register_lowering(prim, lower_cpu, platform="cpu")
    mlir.register_lowering(prim, lower_cuda, platform="cuda")
    if batching_rule is not None:
        batching.primitive_batchers[prim] = batching_rule
    return prim


def fold_batch_axis(x: jax.Array, axis: int | None, size: int) -> jax.Array:
    """Moves a vmapped axis to the front (broadcasting an unbatched operand)."""
    if axis is None:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, axis, 0)
