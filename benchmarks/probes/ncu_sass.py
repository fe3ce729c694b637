"""Summaries of Nsight Compute's per-instruction page (``ncu -i REP --page source --csv --print-source sass``, as
``ncu_profile.sh`` writes it): where a kernel's warps stall, by reason, by opcode and by instruction.

Usage (any machine, no GPU): python benchmarks/probes/ncu_sass.py TAG.sass.csv [--top 40] [--kernel NAME]
    [--rows A:B] [--list A:B]
``--rows``: the summary of SASS rows A..B only (e.g. the compute warpgroups' loop, apart from the memory warpgroup's
spin on its barriers, whose ``BRA`` samples count as "long scoreboard"); ``--list``: print rows A..B with their sample
share and execution count. Samples are of every warp of the kernel, so they also weigh warps that wait.
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"


def load(path: str) -> list[tuple[str, list[dict]]]:
    """[(kernel name, rows)] from the CSV: each kernel's block starts with a "Kernel Name" line and its header."""
    kernels, rows, header, name = [], None, None, None
    with open(path, newline="") as f:
        for line in csv.reader(f):
            if line and line[0] == "Kernel Name":
                name, rows, header = line[1], [], None
                kernels.append((name, rows))
            elif rows is not None and header is None:
                header = line
            elif rows is not None and len(line) >= len(header) - 1:
                rows.append(dict(zip(header, line)))
    return kernels


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    parts = source.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else "?"


def stall_columns(rows: list[dict]) -> list[str]:
    return [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]


def summary(name: str, rows: list[dict], lo: int, hi: int, top: int) -> str:
    total = sum(number(r[SAMPLES]) for r in rows) or 1.0
    part = rows[lo:hi]
    part_total = sum(number(r[SAMPLES]) for r in part) or 1.0
    stalls = stall_columns(rows)
    by_reason, by_op, executed = collections.Counter(), collections.Counter(), collections.Counter()
    for r in part:
        by_op[opcode(r["Source"])] += number(r[SAMPLES])
        executed[opcode(r["Source"])] += number(r["Instructions Executed"])
        for c in stalls:
            by_reason[c[6:]] += number(r[c])
    n_exec = sum(executed.values()) or 1.0
    out = [f"## {name}: SASS rows {lo}..{min(hi, len(rows))} of {len(rows)}, {part_total / total:.1%} of "
           f"{total:.0f} samples",
           "stalls: " + ", ".join(f"{k} {v / part_total:.1%}" for k, v in by_reason.most_common(10)),
           "samples by opcode: " + ", ".join(f"{k} {v / part_total:.1%}" for k, v in by_op.most_common(16)),
           "executed by opcode: " + ", ".join(f"{k} {v / n_exec:.1%}" for k, v in executed.most_common(16)),
           f"top {top} instructions (row, share of all samples, executions, SASS, main reasons):"]
    ranked = sorted(range(lo, min(hi, len(rows))), key=lambda j: -number(rows[j][SAMPLES]))[:top]
    for j in sorted(ranked):
        out.append(line(rows, j, total, stalls))
    return "\n".join(out)


def line(rows: list[dict], j: int, total: float, stalls: list[str]) -> str:
    r = rows[j]
    s = number(r[SAMPLES])
    reasons = sorted(((number(r[c]), c[6:]) for c in stalls), reverse=True)[:2]
    why = " ".join(f"{c}:{v / s:.0%}" for v, c in reasons if v and s)
    return f"{j:5d} {s / total:6.2%} {r['Instructions Executed']:>9s}  {r['Source'].strip()[:72]:72s} {why}"


def span(text: str | None, n: int) -> tuple[int, int]:
    if not text:
        return 0, n
    a, _, b = text.partition(":")
    return int(a or 0), int(b or n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--kernel", help="a substring of the kernel's name (default: every kernel in the file)")
    parser.add_argument("--rows", help="A:B, summarise these SASS rows only")
    parser.add_argument("--list", help="A:B, print these SASS rows")
    args = parser.parse_args()
    for name, rows in load(args.csv):
        if (args.kernel and args.kernel not in name) or not rows:
            continue
        print(summary(name, rows, *span(args.rows, len(rows)), args.top))
        if args.list:
            total = sum(number(r[SAMPLES]) for r in rows) or 1.0
            lo, hi = span(args.list, len(rows))
            for j in range(lo, min(hi, len(rows))):
                print(line(rows, j, total, stall_columns(rows)))


if __name__ == "__main__":
    main()
