"""The training step's optimized HLO beside every kernel's device time, to tell which XLA fusion is which.

Usage (GPU machine, repo root): ``PYTHONPATH=. python benchmarks/probes/step_hlo.py --methods dense sage``.
Writes ``$OUT/step_hlo/<method>.hlo.txt`` (the compiled step's optimized module) and ``<method>.kernels.json``
(ms and launches per step of every kernel of the last traced round, by name: XLA names a fusion's kernel after
the fusion instruction, so the two files join on it).
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.profiling import profile_calls
from benchmarks.training import prepare


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", nargs="+", default=["dense", "sage"])
    ap.add_argument("--preset", default="50m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    out = os.path.join(os.environ.get("OUT", "/tmp"), "step_hlo")
    os.makedirs(out, exist_ok=True)
    for m in args.methods:
        run = prepare(m, args.preset, args.batch, args.seq, args.steps, 2)
        with open(os.path.join(out, f"{m}.hlo.txt"), "w") as f:
            f.write(run["compiled"].as_text())
        prof = profile_calls(run["run"], 1)
        per_step = {n: (ms / args.steps, c / args.steps) for n, (ms, c) in prof["kernels"].items()}
        with open(os.path.join(out, f"{m}.kernels.json"), "w") as f:
            json.dump(dict(busy_ms=prof["busy_ms"] / args.steps, kernels=per_step), f, indent=1)
        print(m, f"busy {prof['busy_ms'] / args.steps:.2f} ms/step", flush=True)


if __name__ == "__main__":
    main()
