"""Test setup: 8 fake CPU devices for sharding tests, the `gpu` marker."""

import os

# Must precede the first jax import of the process.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _gpu_available() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


HAS_GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with jax's CUDA backend (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.devices()}"


@pytest.fixture
def rng():
    """A fresh seed per test run: kernels must work on any valid input."""
    seed = np.random.SeedSequence().entropy % (2**31)
    print(f"seed={seed}")
    return np.random.default_rng(seed)
