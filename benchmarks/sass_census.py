"""Instruction census of the Mosaic GPU kernels' hot loops, from their SASS.

On the GPU machine (its CUDA toolkit has ``ptxas`` and ``cuobjdump``)::

    PYTHONPATH=. python benchmarks/sass_census.py --method sage --shape 16,10,5,2048,64,1

runs one jitted fwd+bwd of the library's defaults (``benchmarks/variants.py``'s child, switches allowed with
``--assign``) with ``MOSAIC_GPU_DUMP_PTX``, assembles each kernel's PTX for sm_90a, disassembles it, and prints
per kernel the opcode counts of its hot loop: the loop with the most tensor-core instructions (``HGMMA``,
``IGMMA``). Loops are backward branches before the kernel's last ``EXIT``; the barrier-wait retry stubs
Mosaic GPU places after it are not loops. The SASS files and ``sass_census.json`` go to ``$OUT``. Per step each
thread of a compute warpgroup runs the loop body once, so the counts are instructions per thread per step
(a 64×64 tile is 32 score elements per thread). ``--sass FILE ...`` prints the census of saved SASS files.

Why: the census showed that three per-tile scales were read by reducing a 64-entry SMEM vector (27
instructions each, every step); reading one element made SageBwd 4–9% faster (benchmarks/NOTES.md,
nineteenth session).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH_TARGET = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)\s*$")
MMA = ("HGMMA", "IGMMA", "QGMMA")


def parse(sass: str) -> list[tuple[int, str]]:
    """``(address, instruction)`` of every instruction in a ``cuobjdump -sass`` listing."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(INSTRUCTION.match, sass.splitlines()) if m]


def opcode(instruction: str) -> str:
    """The opcode with its modifiers (``FMNMX.NAN``), without a predicate guard (``@!P2``)."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", instruction).split()[0]


def loops(instrs: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """``(first, last)`` addresses of each loop: a backward branch located before the last ``EXIT``."""
    exits = [a for a, t in instrs if opcode(t) == "EXIT"]
    end = exits[-1] if exits else float("inf")
    found = []
    for a, t in instrs:
        m = BRANCH_TARGET.search(t)
        if m and a < end and int(m.group(1), 16) <= a:
            found.append((int(m.group(1), 16), a))
    return found


def census(instrs: list[tuple[int, str]], first: int, last: int) -> collections.Counter:
    """Opcode counts of the instructions from ``first`` to ``last`` (addresses, inclusive)."""
    return collections.Counter(opcode(t) for a, t in instrs if first <= a <= last)


def hot_loop(instrs: list[tuple[int, str]]) -> tuple[int, int] | None:
    """The loop with the most tensor-core instructions (then the longest); None without one."""
    def key(span):
        c = census(instrs, *span)
        return sum(n for op, n in c.items() if op.startswith(MMA)), sum(c.values())
    candidates = [span for span in loops(instrs) if key(span)[0]]
    return max(candidates, key=key) if candidates else None


def report(name: str, sass: str, top: int = 40) -> dict:
    """The hot loop's census of one kernel's SASS, as a dict (also printed)."""
    instrs = parse(sass)
    span = hot_loop(instrs)
    if span is None:
        print(f"{name}: no loop with tensor-core instructions ({len(instrs)} instructions)")
        return {"kernel": name, "instructions": len(instrs), "loop": None}
    c = census(instrs, *span)
    total = sum(c.values())
    print(f"{name}: {len(instrs)} instructions; hot loop {span[0]:#x}–{span[1]:#x}: {total} per thread per step")
    print("   " + ", ".join(f"{op} {n}" for op, n in c.most_common(top)))
    return {"kernel": name, "instructions": len(instrs), "loop": [hex(span[0]), hex(span[1])], "loop_instructions":
            total, "census": dict(c.most_common())}


def dump_and_disassemble(args, out: Path) -> dict[str, str]:
    """Run one fwd+bwd with the PTX dump on; return {kernel file name: SASS}."""
    from benchmarks.variants import run_variant

    dump = Path(tempfile.mkdtemp(prefix="sass_census_"))
    run_variant("census", args.assign, [args.shape], args.method, check=False, ptxas=False, part=args.part,
                env={"MOSAIC_GPU_DUMP_TO": str(dump), "MOSAIC_GPU_DUMP_PTX": "1"})
    sass = {}
    for ptx in sorted(dump.glob("*.ptx")):
        cubin = ptx.with_suffix(".cubin")
        subprocess.run(["ptxas", "-arch=sm_90a", "-o", str(cubin), str(ptx)], check=True)
        text = subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
        (out / f"{ptx.stem}.sass").write_text(text)
        sass[ptx.stem] = text
    return sass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=("sage", "qat"), default="sage")
    parser.add_argument("--shape", default="16,10,5,2048,64,1", help="B,Hq,Hkv,S,D,CAUSAL")
    parser.add_argument("--part", choices=("fwd_bwd", "fwd"), default="fwd_bwd")
    parser.add_argument("--assign", default="", help="module switches, as benchmarks/variants.py takes them")
    parser.add_argument("--sass", nargs="*", default=None, help="saved SASS files to census instead (any machine)")
    args = parser.parse_args(argv)
    if args.sass is not None:
        for path in args.sass:
            report(path, Path(path).read_text())
        return 0
    args.shape = [int(x) for x in args.shape.split(",")]
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="sass_out_"))
    out.mkdir(parents=True, exist_ok=True)
    results = [report(name, text) for name, text in dump_and_disassemble(args, out).items()]
    (out / "sass_census.json").write_text(json.dumps({"method": args.method, "shape": args.shape,
                                                      "assign": args.assign, "kernels": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
