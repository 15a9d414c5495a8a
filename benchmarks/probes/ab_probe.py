"""A/B of two builds of a probe: the same configurations, the builds alternated, the times
the probe prints collected into one table (a change is kept when B beats A on every
alternation, not on one run).

    python benchmarks/probes/ab_probe.py A_BINARY B_BINARY [--reps 2] [--env KEY=VAL ...]
        [--pattern REGEX] [--timeout S] -- CONFIG [CONFIG ...]

A CONFIG is the probe's arguments, optionally led by KEY=VAL words that become environment
variables of that run only, e.g. "MLA_LEN=4095 1 16 512 64 4096 64 0". --env sets variables
for every run (e.g. MLA_TIME=1). --pattern's first group is the time (default: the probes'
"time: 12.3 us" line). A run that fails or prints no time is shown as its exit status.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys


def run_once(binary: str, config: str, env: dict, pattern: re.Pattern, timeout: float) -> float | str:
    extra, args = {}, []
    for word in config.split():
        if "=" in word and word[0].isalpha():
            key, value = word.split("=", 1)
            extra[key] = value
        else:
            args.append(word)
    try:
        out = subprocess.run([binary, *args], env={**os.environ, **env, **extra}, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    m = pattern.search(out.stdout)
    if m is None:
        return f"rc={out.returncode}"
    return float(m.group(1)) if out.returncode == 0 else f"rc={out.returncode} ({m.group(1)})"


def _fmt(times) -> str:
    return " ".join(f"{t:.2f}" if isinstance(t, float) else t for t in times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("configs", nargs="+")
    p.add_argument("--reps", type=int, default=2, help="alternations (A then B, per configuration)")
    p.add_argument("--env", action="append", default=[], help="KEY=VAL for every run")
    p.add_argument("--pattern", default=r"time: ([\d.]+) us")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    env = dict(e.split("=", 1) for e in args.env)
    pattern = re.compile(args.pattern)
    times = {(c, k): [] for c in args.configs for k in "ab"}
    for rep in range(args.reps):
        for config in args.configs:
            for key, binary in (("a", args.a), ("b", args.b)):
                times[(config, key)].append(run_once(binary, config, env, pattern, args.timeout))
        print(f"alternation {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    width = max(len(c) for c in args.configs)
    print(f"{'configuration':{width}s} | A | B | B / A (medians)")
    for config in args.configs:
        a, b = times[(config, "a")], times[(config, "b")]
        ok = all(isinstance(t, float) for t in a + b)
        ratio = f"{statistics.median(b) / statistics.median(a):.3f}" if ok else "-"
        print(f"{config:{width}s} | {_fmt(a)} | {_fmt(b)} | {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
