"""Start N processes on this host, one per GPU, joined by ``jax.distributed`` (no MPI).

    python -m jax_cluster.parallel.launch -n 2 -- python script.py --flag
    python -m jax_cluster.parallel.launch -n 2 --timeout 600 -- python -m pytest -q tests/x.py

and in the script (or a test's child)::

    from jax_cluster.parallel.launch import init_distributed
    rank, world = init_distributed()          # before the first computation

Each child gets ``JAX_CLUSTER_RANK``, ``JAX_CLUSTER_WORLD`` and ``JAX_CLUSTER_COORDINATOR``
(``127.0.0.1:<free port>``) and ``JAX_CLUSTER_RENDEZVOUS`` (a directory the launcher owns for
the run: the small values the ranks exchange before any device program, e.g. NVSHMEM's
unique id; removed at the end); where GPUs are present (``gpus="auto"``) also
``CUDA_VISIBLE_DEVICES=<rank>`` so each process sees one GPU, and ``NVSHMEM_DISABLE_NVLS=1``,
``NCCL_NVLS_ENABLE=0`` unless already set (NVLink multicast stays off). Output lines are
prefixed with ``[rank r]``. The first child to exit non-zero decides the exit code and the
others are killed; past ``timeout`` every child is killed and the code is 124. Nothing waits
without a bound.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence, TextIO

ENV_RANK = "JAX_CLUSTER_RANK"
ENV_WORLD = "JAX_CLUSTER_WORLD"
ENV_COORDINATOR = "JAX_CLUSTER_COORDINATOR"
ENV_RENDEZVOUS = "JAX_CLUSTER_RENDEZVOUS"
TIMEOUT_EXIT_CODE = 124
_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def count_gpus() -> int:
    """NVIDIA GPUs on this host, without importing jax (the parent must not claim a GPU)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([x for x in visible.split(",") if x.strip() and x.strip() != "-1"])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _visible_gpu(rank: int) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # keep the parent's choice: rank r gets its r-th entry
        return [x.strip() for x in visible.split(",") if x.strip()][rank]
    return str(rank)


def child_env(rank: int, world: int, coordinator: str, *, gpus: bool, rendezvous: str = "",
              base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    if rendezvous:
        env[ENV_RENDEZVOUS] = rendezvous
    env[ENV_RANK] = str(rank)
    env[ENV_WORLD] = str(world)
    env[ENV_COORDINATOR] = coordinator
    env["PYTHONUNBUFFERED"] = "1"
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = _visible_gpu(rank)
        env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        env.setdefault("NCCL_NVLS_ENABLE", "0")
    if extra:
        env.update(extra)
    return env


@dataclass
class LaunchResult:
    returncode: int  # first non-zero exit code in time order, 124 on timeout, else 0
    returncodes: list  # per rank; None where the child was killed before it exited on its own
    output: list = field(default_factory=list)  # per rank: list of lines (without prefix)
    failed_rank: int | None = None
    timed_out: bool = False

    def text(self, rank: int) -> str:
        return "".join(self.output[rank])


def _pump(rank: int, pipe, sink: TextIO | None, lines: list, lock: threading.Lock, prefix: bool):
    for line in iter(pipe.readline, ""):
        lines.append(line)
        if sink is not None:
            with lock:
                sink.write(f"[rank {rank}] {line}" if prefix else line)
                sink.flush()
    pipe.close()


def _kill(procs, sig) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)  # the child's whole group: it may have started its own
            except (ProcessLookupError, PermissionError):
                pass


def launch(cmd: Sequence[str], nprocs: int = 2, *, timeout: float = 600.0, gpus: bool | str = "auto",
           port: int | None = None, env: Mapping[str, str] | None = None,
           stream: TextIO | None = sys.stdout, prefix: bool = True, cwd: str | None = None) -> LaunchResult:
    """Run ``cmd`` as ``nprocs`` processes of ranks 0..nprocs-1 and wait for all of them.

    ``gpus``: "auto" gives each rank one GPU when the host has GPUs, True requires them
    (ValueError when fewer than ``nprocs``), False never sets ``CUDA_VISIBLE_DEVICES``.
    ``env``: extra variables for every child. ``stream``: where prefixed output goes
    (None: only captured in the result). Never blocks longer than ``timeout`` (+ a few
    seconds to kill)."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if not cmd:
        raise ValueError("empty command")
    n_gpus = count_gpus()
    if gpus == "auto":
        use_gpus = n_gpus > 0
    else:
        use_gpus = bool(gpus)
    if use_gpus and n_gpus < nprocs:
        raise ValueError(f"{nprocs} processes need {nprocs} GPUs (one each); this host shows {n_gpus}")
    coordinator = f"127.0.0.1:{port or free_port()}"
    lock = threading.Lock()
    procs, pumps, outputs = [], [], []
    rendezvous = tempfile.mkdtemp(prefix="jax_cluster_rendezvous_")
    start = time.monotonic()
    try:
        for rank in range(nprocs):
            e = child_env(rank, nprocs, coordinator, gpus=use_gpus, rendezvous=rendezvous, extra=env)
            p = subprocess.Popen(list(cmd), env=e, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True)
            procs.append(p)
            outputs.append([])
            t = threading.Thread(target=_pump, args=(rank, p.stdout, stream, outputs[-1], lock, prefix),
                                 daemon=True)
            t.start()
            pumps.append(t)
        codes: list = [None] * nprocs
        first_bad, failed_rank, timed_out = 0, None, False
        while True:
            for r, p in enumerate(procs):
                if codes[r] is None and p.poll() is not None:
                    codes[r] = p.returncode
                    if p.returncode != 0 and first_bad == 0:
                        first_bad, failed_rank = p.returncode, r
            if all(c is not None for c in codes):
                break
            if first_bad:
                break
            if time.monotonic() - start > timeout:
                timed_out = True
                break
            time.sleep(0.05)
        if timed_out or first_bad:
            why = (f"timed out after {timeout:g} s" if timed_out
                   else f"rank {failed_rank} exited with code {first_bad}")
            if stream is not None:
                with lock:
                    stream.write(f"[launch] {why}: stopping the other ranks\n")
                    stream.flush()
    finally:
        _kill(procs, signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        _kill(procs, signal.SIGKILL)
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(1.0)
        shutil.rmtree(rendezvous, ignore_errors=True)
    returncode = TIMEOUT_EXIT_CODE if timed_out else first_bad
    return LaunchResult(returncode, codes, outputs, failed_rank, timed_out)


# ----------------------------------------------------------------------------- child side
def rank_and_world() -> tuple[int, int]:
    """This process's (rank, world) from the launcher's variables; (0, 1) when not launched."""
    if ENV_RANK not in os.environ:
        return 0, 1
    return int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD])


def init_distributed(timeout_s: int = 120, shutdown_timeout_s: int = 60) -> tuple[int, int]:
    """``jax.distributed.initialize`` from the launcher's variables; returns (rank, world).

    A process not started by the launcher (single process) is left alone: (0, 1). Calling it
    twice is harmless. ``timeout_s`` bounds the wait for the other ranks to connect,
    ``shutdown_timeout_s`` the wait for them at exit."""
    import jax

    rank, world = rank_and_world()
    if world == 1 or jax.distributed.is_initialized():
        return rank, world
    jax.distributed.initialize(os.environ[ENV_COORDINATOR], num_processes=world, process_id=rank,
                               initialization_timeout=int(timeout_s),
                               shutdown_timeout_seconds=int(shutdown_timeout_s))
    return rank, world


# -------------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, cmd = argv[:i], argv[i + 1:]
    else:
        own, cmd = argv, []
    ap = argparse.ArgumentParser(prog="python -m jax_cluster.parallel.launch",
                                 description="Start N local processes joined by jax.distributed.")
    ap.add_argument("-n", "--nprocs", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before every rank is killed")
    ap.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    ap.add_argument("--gpus", choices=("auto", "yes", "no"), default="auto",
                    help="one GPU per rank via CUDA_VISIBLE_DEVICES (auto: when the host has GPUs)")
    ap.add_argument("--no-prefix", action="store_true")
    args = ap.parse_args(own)
    if not cmd:
        ap.error("give the command after --")
    gpus = {"auto": "auto", "yes": True, "no": False}[args.gpus]
    # SIGTERM to the launcher stops the ranks too (launch's cleanup runs on SystemExit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    res = launch(cmd, args.nprocs, timeout=args.timeout, gpus=gpus, port=args.port, prefix=not args.no_prefix)
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
