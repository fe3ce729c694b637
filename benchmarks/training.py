"""Training-step throughput on the GPU: dense (cuDNN) vs sage attention in the same run.

Usage (GPU machine, repo root):
    PYTHONPATH=. python benchmarks/training.py                 # preset 50m, sequence 2048
    PYTHONPATH=. python benchmarks/training.py --smoke         # tiny model, runs anywhere

Tokens/s of the jitted data-parallel train step (fwd + bwd + AdamW) and model
FLOP utilisation: 6·N + 6·L·S·d FLOPs per token (the parameters' matmuls plus
causal attention, 12·L·S·d halved) over the device's dense bf16 peak.
Writes benchmarks/results/training.json (and $OUT/training.json).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import jax
import numpy as np

from benchmarks.common import environment, write_json
from train.data import PackedBatches, load_corpus
from train.loop import TrainConfig, build

warnings.filterwarnings("ignore", category=DeprecationWarning)
PEAK_BF16 = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12}


def flops_per_token(cfg, seq: int, n_params: int) -> float:
    """6·N (dense matmuls, fwd+bwd) + causal attention 6·L·S·d (12·L·S·d halved)."""
    return 6.0 * n_params + 6.0 * cfg.num_layers * seq * cfg.dim


def measure(method: str, preset: str, batch: int, seq: int, steps: int, log) -> dict:
    cfg = TrainConfig(preset=preset, method=method, batch=batch, seq=seq, steps=steps + 2, max_corpus_mb=8)
    b = build(cfg.resolved())
    data = PackedBatches(load_corpus(None, 8 * 2**20), seq, batch, 1, 0)
    params, opt_state = b["params"], b["tx"].init(b["params"])
    n_params = sum(x.size for x in jax.tree.leaves(params))
    batches = [jax.numpy.asarray(data.batch(i)) for i in range(steps + 2)]
    for i in range(2):  # compile + warm up
        params, opt_state, m = b["train_step"](params, opt_state, batches[i])
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(2, steps + 2):
        params, opt_state, m = b["train_step"](params, opt_state, batches[i])
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / steps
    tok_s = batch * seq / dt
    peak = PEAK_BF16.get(jax.devices()[0].device_kind)
    mfu = flops_per_token(b["model_config"], seq, n_params) * tok_s / peak if peak else None
    row = dict(method=method, preset=preset, params=n_params, batch=batch, seq=seq, step_ms=dt * 1e3,
               tokens_per_s=tok_s, mfu=mfu, final_loss=float(m["loss"]))
    log(f"{method:6s} {preset} ({n_params / 1e6:.1f}M) B{batch} S{seq}: {dt * 1e3:.1f} ms/step, "
        f"{tok_s:,.0f} tokens/s" + (f", MFU {mfu:.1%}" if mfu else ""))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--methods", nargs="+", default=["dense", "sage"], help="attention methods, dense first")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.smoke:
        print("benchmarks/training.py needs a GPU (or --smoke)")
        return 2
    preset, seq, batch = ("tiny", 128, 8) if args.smoke else ("50m", 2048, args.batch)
    payload = dict(env=environment(), command="PYTHONPATH=. python benchmarks/training.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), rows=[])
    rows = payload["rows"]
    for method in args.methods:
        rows.append(measure(method, preset, batch, seq, 2 if args.smoke else args.steps, print))
        by = {r["method"]: r["tokens_per_s"] for r in rows}
        payload["vs_dense"] = {m: t / by["dense"] for m, t in by.items()} if "dense" in by else {}
        payload["sage_vs_dense"] = payload["vs_dense"].get("sage")
        write_json("training_smoke" if args.smoke else "training", payload)
    print("tokens/s relative to dense: " + ", ".join(f"{m} {r:.2f}" for m, r in payload["vs_dense"].items()))
    np.testing.assert_(all(np.isfinite(r["final_loss"]) for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
