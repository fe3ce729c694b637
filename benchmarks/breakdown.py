"""Where the time goes, by device kernel (a ``jax.profiler`` trace): the training step and attention fwd+bwd.

Usage (GPU machine, repo root):
    PYTHONPATH=. python benchmarks/breakdown.py            # 50m train step + attention shapes
    PYTHONPATH=. python benchmarks/breakdown.py --smoke    # tiny shapes, runs anywhere

Part 1, the training step (benchmarks/training.py's model and step): every method is compiled
first, then each round traces ``--steps`` steps of every method in turn. Per step it reports the
host wall time, the device's busy time (the union of kernel intervals) and the kernel time in
groups (attention kernels, matrix products, the rest). Busy ≪ wall means launch gaps or the
host bind the step. Part 2: per-kernel device time of one attention fwd+bwd for sage, qat and
cuDNN at the training model's attention shape and at D128 (and sage with the Mosaic forward; at D64 qat
with 128-key forward tiles).
Writes benchmarks/results/breakdown.json (and $OUT/breakdown.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import subprocess
import sys
import warnings

import jax
import numpy as np

import lowbit_jax as lb

from benchmarks.attention import make_inputs
from benchmarks.attention_bwd import attention_fn
from benchmarks.common import environment, fwd_bwd, write_json
from benchmarks.dq_kernel import method_fn
from benchmarks.profiling import grouped, kinds_in_group, profile_calls
from benchmarks.render_results import kinds_by_spread
from benchmarks.training import prepare

warnings.filterwarnings("ignore", category=DeprecationWarning)

GROUPS = {  # lower-cased substrings of kernel names
    "attention": ("sage", "qat", "fp4", "mosaic", "fmha", "cudnn", "flash", "sdpa"),
    "matmul": ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90", "triton_dot", "dot"),
}
SHAPES = [(16, 10, 5, 2048, 64, True), (4, 32, 32, 4096, 128, False)]  # (B, Hq, Hkv, S, D, causal)
SMOKE_SHAPES = [(1, 2, 1, 256, 64, True)]


def gpu_state() -> str:
    """Clocks, temperature, power and utilisation as nvidia-smi reports them (read only)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,"
                               "power.draw,utilization.gpu,clocks_throttle_reasons.active", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi unavailable: {e}"


def summary(prof: dict, per: int = 1) -> dict:
    """Per-step (per ``per`` calls) numbers of a :func:`profile_calls` result."""
    return dict(wall_ms=prof["wall_ms"] / per, busy_ms=prof["busy_ms"] / per, kernel_ms=prof["kernel_ms"] / per,
                groups={g: ms / per for g, ms in grouped(prof["kernels"], GROUPS).items()},
                launches=sum(c for _, c in prof["kernels"].values()) / per,
                top=[(n[:90], ms / per, c / per) for n, (ms, c) in list(prof["kernels"].items())[:25]],
                other_kinds=[(k[:90], ms / per, c / per) for k, ms, c in kinds_in_group(prof["kernels"], GROUPS)])


def training_part(methods, preset, batch, seq, steps, rounds, log) -> dict:
    runs = {m: prepare(m, preset, batch, seq, steps, rounds + 1) for m in methods}
    out = {m: [] for m in methods}
    for r in range(rounds):
        for m in methods:
            out[m].append(summary(profile_calls(runs[m]["run"], 1), steps))  # one call = ``steps`` steps
        log(f"round {r + 1}: " + "; ".join(f"{m} wall {out[m][-1]['wall_ms']:.1f} busy {out[m][-1]['busy_ms']:.1f}"
                                           for m in methods) + f" | {gpu_state()}")
    for m in methods:
        last = out[m][-1]
        log(f"\n== {m}: wall/step {[round(x['wall_ms'], 1) for x in out[m]]}, busy/step "
            f"{[round(x['busy_ms'], 1) for x in out[m]]}, launches/step {last['launches']:.0f}, groups "
            + ", ".join(f"{g} {ms:.1f}" for g, ms in sorted(last["groups"].items())))
        for name, ms, cnt in last["top"][:18]:
            log(f"   {ms:8.3f} ms  x{cnt:5.1f}  {name}")
    log(other_kinds_table({m: out[m][-1]["other_kinds"] for m in methods}))
    return out


def other_kinds_table(kinds: dict[str, list], rows: int = 20) -> str:
    """The "other" kernels' ms per step by kind, one column per method (``summary``'s ``other_kinds``), the kinds
    whose times differ most between the methods first: where a method's step spends outside attention and the
    matrix products."""
    methods = list(kinds)
    ms = {m: {k: t for k, t, _ in rows_} for m, rows_ in kinds.items()}
    names = kinds_by_spread(ms)
    lines = ["\n== other kernels by kind, ms/step: " + " | ".join(methods)]
    lines += [f"   {' | '.join(f'{ms[m].get(k, 0.0):7.3f}' for m in methods)}  {k}" for k in names[:rows]]
    return "\n".join(lines)


def attention_part(shapes, interpret, log) -> list[dict]:
    rows = []
    for b, hq, hkv, s, d, causal in shapes:
        q, _, _ = make_inputs(jax.random.key(0), b, hq, s, d)
        _, k, v = make_inputs(jax.random.key(1), b, hkv, s, d)
        do = make_inputs(jax.random.key(2), b, hq, s, d)[0]
        fns = {"sage": method_fn("sage", causal, "auto", d=d, interpret=interpret),
               "qat": method_fn("qat", causal, "auto", d=d, interpret=interpret)}
        if not interpret:
            # the default forward on Hopper is the Mosaic one (fwd_backend "auto", head dims 64 and 128): the
            # alternative beside it is the Triton forward
            cfg = dataclasses.replace(lb.sage_fwd_config(d, causal), fwd_backend="triton")
            fns["sage_fwd_triton"] = functools.partial(lb.sage_attention, causal=causal, config=cfg)
            fns["cudnn_bf16"] = attention_fn("cudnn_bf16", d, causal)
        for name, fn in fns.items():
            step = fwd_bwd(fn)
            jax.block_until_ready(step(q, k, v, do))
            prof = summary(profile_calls(lambda: jax.block_until_ready(step(q, k, v, do)), 5))
            rows.append(dict(shape=[b, hq, hkv, s, d, causal], method=name, **prof))
            log(f"\n-- {name} B{b} H{hq}/{hkv} S{s} D{d} causal={causal}: busy {prof['busy_ms']:.3f} ms, kernels "
                f"{prof['kernel_ms']:.3f} ms, wall {prof['wall_ms']:.3f} ms")
            for kname, ms, cnt in prof["top"][:14]:
                log(f"   {ms:8.3f} ms  x{cnt:4.1f}  {kname}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--methods", nargs="+", default=["dense", "sage", "qat_fp4"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-training", action="store_true")
    parser.add_argument("--no-attention", action="store_true")
    args = parser.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    if not gpu and not args.smoke:
        print("benchmarks/breakdown.py needs a GPU (or --smoke)")
        return 2

    def log(msg):
        print(msg, flush=True)

    log(f"GPU state at start: {gpu_state()}")
    payload = dict(env=environment(), command="PYTHONPATH=. python benchmarks/breakdown.py " + " ".join(
        argv if argv is not None else sys.argv[1:]))
    if not args.no_training:
        preset, seq, batch = ("tiny", 128, 8) if args.smoke else ("50m", 2048, 16)
        steps, rounds = (2, 1) if args.smoke else (args.steps, args.rounds)
        payload["training"] = dict(preset=preset, seq=seq, batch=batch, steps=steps,
                                   rounds=training_part(args.methods, preset, batch, seq, steps, rounds, log))
        dense = payload["training"]["rounds"].get("dense")
        if dense:
            for m, rs in payload["training"]["rounds"].items():
                log(f"{m}: busy-time ratio dense/{m} per round "
                    f"{[round(a['busy_ms'] / max(x['busy_ms'], 1e-9), 3) for a, x in zip(dense, rs)]}, wall ratio "
                    f"{[round(a['wall_ms'] / x['wall_ms'], 3) for a, x in zip(dense, rs)]}")
    if not args.no_attention:
        payload["attention"] = attention_part(SMOKE_SHAPES if args.smoke else SHAPES, not gpu, log)
    log(f"GPU state at end: {gpu_state()}")
    write_json("breakdown_smoke" if args.smoke else "breakdown", payload)
    np.testing.assert_(not gpu or all(r["busy_ms"] > 0 for r in payload.get("attention", [])),
                       "no GPU kernel events in the trace")
    return 0


if __name__ == "__main__":
    sys.exit(main())
