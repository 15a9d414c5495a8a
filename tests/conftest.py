"""Test setup: 8 fake CPU devices for sharding tests, the `gpu` marker, `--shard K/N`, and
`probe_tool` / `bench_tool` (a script of benchmarks/probes/ or benchmarks/ loaded as a module)."""

import importlib.util
import os
from pathlib import Path

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


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run every N-th collected test from the K-th (0 <= K < N): the GPU suite in "
                          "pieces that each fit one call of a time-limited machine")


def _take_shard(config, items):
    spec = config.getoption("--shard")
    if spec is None:
        return
    try:
        k, n = (int(v) for v in spec.split("/"))
    except ValueError:
        k = n = 0
    if not 0 <= k < n:
        raise pytest.UsageError(f"--shard {spec!r}: expected K/N with 0 <= K < N, e.g. 0/3")
    # every N-th test, not a slice: each shard gets a share of every file's slow tests
    kept = [item for i, item in enumerate(items) if i % n == k]
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k])
    items[:] = kept


def pytest_collection_modifyitems(config, items):
    _take_shard(config, items)
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


def _load_script(folder: str, name: str):
    """benchmarks/<folder>/<name>.py loaded as a module (the benchmarks are scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_{folder.replace('/', '_')}_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def probe_tool():
    """probe_tool("ab_probe"): benchmarks/probes/ab_probe.py loaded as a module."""
    return lambda name: _load_script("probes", name)


@pytest.fixture
def bench_tool():
    """bench_tool("plot"): benchmarks/plot.py loaded as a module."""
    return lambda name: _load_script("", name)
