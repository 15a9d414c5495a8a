"""Loads the compiled FFI modules and registers their targets with XLA.

The CPU module is always built. The CUDA module exists when the package was
built with a CUDA toolkit (JAX_CLUSTER_CUDA=ON|AUTO) and registers only where
jax has a CUDA backend.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import jax

_REBUILD_HINT = (
    "Rebuild jax_cluster on a machine with the CUDA toolkit (nvcc 12.4+ for sm_90a): "
    "`JAX_CLUSTER_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -v .`"
)


def _import(name: str):
    try:
        return importlib.import_module(f"jax_cluster.{name}"), None
    except ImportError as exc:  # missing or unloadable module
        return None, exc


_cpu_module, _cpu_error = _import("_jax_cluster_cpu")
_cuda_module, _cuda_error = _import("_jax_cluster_cuda")


# jax's CUDA backends come as PJRT plugins (jax-cuda12-plugin / jax-cuda13-plugin).
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12", "jax_cuda13_plugin", "jax_cuda12_plugin")


def _has_cuda_backend() -> bool:
    """Whether jax can have a CUDA backend here, asked WITHOUT initialising any backend: the
    targets register at import, and a multi-process program must be able to import
    jax_cluster before jax.distributed.initialize (which refuses once a backend is up).
    Targets registered for a platform that is not up yet are queued by XLA until it is."""
    for name in _CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):  # a parent package that is missing or odd
            continue
    return False


@functools.cache
def register_targets() -> dict[str, tuple[str, ...]]:
    """Registers every available FFI target once; returns {platform: target names}."""
    registered: dict[str, tuple[str, ...]] = {}
    if _cpu_module is None:
        raise ImportError(
            "jax_cluster's CPU extension module is missing: the package was not built. "
            "Install it with `python3 -m pip install .`"
        ) from _cpu_error
    for name, capsule in _cpu_module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    registered["cpu"] = tuple(_cpu_module.registrations())
    if _cuda_module is not None and _has_cuda_backend():
        for name, capsule in _cuda_module.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        registered["cuda"] = tuple(_cuda_module.registrations())
    return registered


def plans():
    """The C++ launch-plan functions (cpp/ops/<op>/plan.cc), from the CPU module."""
    register_targets()  # raises the clear error when the package was not built
    return _cpu_module.plans


def cuda_module_built() -> bool:
    return _cuda_module is not None


def require_cuda_target(target: str) -> None:
    """Raises a clear error when a CUDA lowering needs a target that was not built."""
    if target in register_targets().get("cuda", ()):
        return
    if _cuda_module is None:
        raise RuntimeError(
            f"{target}: jax_cluster was built without its CUDA module "
            f"({_cuda_error}). {_REBUILD_HINT}"
        )
    raise RuntimeError(f"{target}: the CUDA module has no such target. {_REBUILD_HINT}")
