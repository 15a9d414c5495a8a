"""Global loads that wait for each other, found in a kernel's SASS without a GPU.

A thread issues its instructions in order. A load whose value is used (by arithmetic or a
store) before the next load is issued makes that next load wait a whole memory round trip:
staging loops that load and store in one iteration, epilogues that read the residual after
storing the previous output (the store may alias it), reductions whose loads sit behind a
branch. The compiler cannot batch such loads itself, and in the PTX they are hard to judge
(ptxas predicates and reschedules), so this reads the final SASS:

- chains: runs of LDG in straight-line code, each used before the next is issued (a run of
  n costs about n round trips, 0.2-0.7 us each);
- loops: backward branches whose body issues LDGs and uses a result before the branch
  (every iteration then waits for its own loads).

    nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \\
        -Icpp -Icpp/include -cubin cpp/ops/swiglu/launch_tma.cu -o /tmp/k.cubin
    python benchmarks/probes/sass_load_chains.py /tmp/k.cubin [--kernel NAME] [--min 4] [--loops]

cuobjdump comes with the CUDA toolkit, or from PyPI (`pip install nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm`: its -sass calls nvdisasm, found on PATH; both binaries under
nvidia/cu*/bin); --cuobjdump names it. A finding is a place to look, not a
verdict: warps of one block overlap each other's waits, and a chain off the hot path costs
little.
"""

from __future__ import annotations

import argparse
import glob
import re
import shutil
import subprocess
import sys
from pathlib import Path

_INST = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_REG = re.compile(r"\bR(\d+)\b")
_STORES = ("STG", "STS", "ST.", "RED", "ATOM")


def _is_load(op: str) -> bool:
    """A global load into registers; cp.async (LDGSTS: global to shared, waited for by its
    own barrier) and its LDGDEPBAR are not: their register operands are addresses."""
    return op.startswith("LDG") and not op.startswith(("LDGSTS", "LDGDEPBAR"))


def functions(sass: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """(name, [(address, instruction)]) of every function in cuobjdump -sass output."""
    out = []
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name = part.split("\n", 1)[0].strip()
        insts = [(int(a, 16), re.sub(r"^@!?U?P\w+\s+", "", i.strip())) for a, i in _INST.findall(part)]
        out.append((name, insts))
    return out


def _loaded(op: str, regs: list[str]) -> set[str]:
    width = 4 if ".128" in op else 2 if ".64" in op else 1
    return {str(int(regs[0]) + i) for i in range(width)} if regs else set()


def _reads(op: str, regs: list[str]) -> set[str]:
    return set(regs if op.startswith(_STORES) else regs[1:])


def longest_chain(insts: list[tuple[int, str]]) -> tuple[int, int | None]:
    """Longest run of LDGs each used before the next is issued, and the address it ends at."""
    chain = best = 0
    end = None
    pending: set[str] | None = None
    used = False
    for addr, ins in insts:
        op = ins.split()[0] if ins else ""
        regs = _REG.findall(ins)
        if _is_load(op):
            if pending is not None:
                chain = chain + 1 if used else 0
                if chain > best:
                    best, end = chain, addr
            pending, used = _loaded(op, regs), False
        elif pending and not used and _reads(op, regs) & pending:
            used = True
    return best, end


def waiting_loops(insts: list[tuple[int, str]], max_body: int = 400) -> list[tuple[int, int, int, int]]:
    """(start, end, loads, waits) of each loop whose body uses a loaded value before its
    backward branch; waits = how many times a use finds loads still in flight."""
    where = {a: k for k, (a, _) in enumerate(insts)}
    found = []
    for k, (addr, ins) in enumerate(insts):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= addr or target not in where or k - where[target] > max_body:
            continue
        loads = waits = 0
        pending: set[str] = set()
        for _, b in insts[where[target]:k + 1]:
            op = b.split()[0] if b else ""
            regs = _REG.findall(b)
            if _is_load(op):
                loads += 1
                pending |= _loaded(op, regs)
            elif pending & _reads(op, regs):
                waits += 1
                pending = set()
        if loads and waits:
            found.append((target, addr, loads, waits))
    return found


def find_cuobjdump(given: str | None) -> str:
    if given:
        return given
    path = shutil.which("cuobjdump")
    if path:
        return path
    for site in sys.path:  # the nvidia-cuda-cuobjdump wheel
        hits = glob.glob(str(Path(site) / "nvidia" / "cu*" / "bin" / "cuobjdump"))
        if hits:
            return hits[0]
    sys.exit("cuobjdump not found: install the CUDA toolkit or `pip install nvidia-cuda-cuobjdump`, "
             "or pass --cuobjdump")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cubin", help="a cubin (nvcc -cubin) or an object file with device code")
    p.add_argument("--kernel", default="", help="only functions whose mangled name contains this")
    p.add_argument("--min", type=int, default=4, help="shortest chain to report (default 4)")
    p.add_argument("--loops", action="store_true", help="also list loops that wait for their own loads")
    p.add_argument("--cuobjdump", default=None)
    args = p.parse_args(argv)
    sass = subprocess.run([find_cuobjdump(args.cuobjdump), "-sass", args.cubin],
                          capture_output=True, text=True, check=True).stdout
    for name, insts in functions(sass):
        if args.kernel not in name:
            continue
        chain, end = longest_chain(insts)
        if chain >= args.min:
            print(f"chain of {chain:3d} loads ending at {end:#x}  {name}")
        if args.loops:
            for start, stop, loads, waits in waiting_loops(insts):
                print(f"loop {start:#x}-{stop:#x}: {loads} loads, {waits} waits per iteration  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
