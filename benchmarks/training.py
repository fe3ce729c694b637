"""Training-step throughput on the GPU: dense (cuDNN) vs sage attention in the same run.

Usage (GPU machine, repo root):
    PYTHONPATH=. python benchmarks/training.py                 # preset 50m, sequence 2048
    PYTHONPATH=. python benchmarks/training.py --preset 300m --batch 2   # head dim 128, sequence 8192
    PYTHONPATH=. python benchmarks/training.py --smoke         # tiny model, runs anywhere
    PYTHONPATH=. python benchmarks/training.py --methods dense sage sage:row qat_fp4
                                    # METHOD:DS_SCALE = sage with TrainConfig.ds_scale (dS per row)
    PYTHONPATH=. python benchmarks/training.py --methods dense sage dense@block sage@block
                                    # METHOD@REMAT = with ModelConfig.remat ("block", "dots")

Tokens/s of the jitted data-parallel train step (fwd + bwd + AdamW) and model
FLOP utilisation: 6·N + 6·L·S·d FLOPs per token (the parameters' matmuls plus
causal attention, 12·L·S·d halved) over the device's dense bf16 peak. Every method
is compiled first, then timed in ``--rounds`` interleaved windows of ``--steps``
steps (median per method; the ratio to dense is the median of per-round ratios),
because back-to-back single windows drifted by up to 35% on the lent H200.
Each row also gives the compiled step's XLA temporary memory (``memory_analysis().temp_size_in_bytes``:
activations, residuals and workspaces; parameters and optimizer state are arguments, not temporaries),
which is what ``ModelConfig.remat`` trades against time.
Writes benchmarks/results/training.json (training_<preset>.json for other presets; and the same under $OUT).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import jax
import numpy as np

from benchmarks.common import environment, write_json
from models.presets import PRESETS
from train.data import PackedBatches, load_corpus
from train.loop import TrainConfig, build

warnings.filterwarnings("ignore", category=DeprecationWarning)
PEAK_BF16 = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12}


def flops_per_token(cfg, seq: int, n_params: int) -> float:
    """6·N (dense matmuls, fwd+bwd) + causal attention 6·L·S·d (12·L·S·d halved)."""
    return 6.0 * n_params + 6.0 * cfg.num_layers * seq * cfg.dim


def prepare(method: str, preset: str, batch: int, seq: int, steps: int, rounds: int) -> dict:
    """A compiled, warmed-up train step for ``method`` (a model method; "sage:row": sage with dS scaled per
    row; "sage~unfused", "qat_fp4~unfused": QK-norm and RoPE by XLA, not in the attention's kernels
    (``ModelConfig.fuse_qk_prologue``);
    "METHOD@block" / "METHOD@dots": with ``ModelConfig.remat``) and ``run()``, which times ``steps`` steps
    and returns seconds per step (called once to warm up, then ``rounds`` times: the LR schedule spans all
    those steps)."""
    base, _, remat = method.partition("@")
    base, _, unfused = base.partition("~")
    base, _, ds_scale = base.partition(":")
    if unfused not in ("", "unfused"):
        raise ValueError(f"method {method!r}: the only '~' variant is '~unfused'")
    cfg = TrainConfig(preset=preset, method=base, batch=batch, seq=seq, steps=steps * (rounds + 1), max_corpus_mb=8,
                      ds_scale=ds_scale or "tile", remat=remat or "none", fuse_qk_prologue=not unfused)
    b = build(cfg.resolved())
    data = PackedBatches(load_corpus(None, 8 * 2**20), seq, batch, 1, 0)
    state = dict(params=b["params"], opt_state=b["tx"].init(b["params"]), metrics=None)
    batches = [jax.numpy.asarray(data.batch(i)) for i in range(steps)]
    step = b["train_step"].lower(state["params"], state["opt_state"], batches[0]).compile()
    memory = step.memory_analysis()
    temp_bytes = None if memory is None else int(memory.temp_size_in_bytes)

    def run() -> float:
        t0 = time.perf_counter()
        for tokens in batches:
            state["params"], state["opt_state"], state["metrics"] = step(state["params"], state["opt_state"], tokens)
        jax.block_until_ready(state["metrics"])
        return (time.perf_counter() - t0) / steps

    run()  # warm up (compiled above)
    n_params = sum(x.size for x in jax.tree.leaves(b["params"]))
    return dict(run=run, state=state, n_params=n_params, flops=flops_per_token(b["model_config"], seq, n_params),
                temp_bytes=temp_bytes, remat=cfg.remat, compiled=step)


def baseline(method: str) -> str:
    """The dense method a method is compared with: the one with the same ``@REMAT`` suffix."""
    _, at, remat = method.partition("@")
    return "dense" + at + remat


def ratios_to_dense(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per-round (paired) ratios, dense step time / method step time, each method against the dense run with
    the same remat (:func:`baseline`); methods without that dense run are left out."""
    return {m: [float(d / t) for d, t in zip(times[baseline(m)], ts)] for m, ts in times.items()
            if baseline(m) in times}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--preset", default="50m", choices=sorted(PRESETS), help="model size")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's max_len)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed window")
    parser.add_argument("--rounds", type=int, default=3, help="timed windows per method, interleaved")
    parser.add_argument("--methods", nargs="+", default=["dense", "sage"], help="attention methods, dense first")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.smoke:
        print("benchmarks/training.py needs a GPU (or --smoke)")
        return 2
    preset, batch = ("tiny", 8) if args.smoke else (args.preset, args.batch)
    seq = 128 if args.smoke else (args.seq or PRESETS[preset].max_len)
    steps, rounds = (2, 2) if args.smoke else (args.steps, args.rounds)
    payload = dict(env=environment(), command="PYTHONPATH=. python benchmarks/training.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), rows=[], rounds=rounds, steps_per_round=steps)
    runs = {m: prepare(m, preset, batch, seq, steps, rounds) for m in args.methods}
    times = {m: [] for m in args.methods}
    for r in range(rounds):  # round-robin: clock drift and neighbours hit every method alike
        for m in args.methods:
            times[m].append(runs[m]["run"]())
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{m} {times[m][-1] * 1e3:.1f} ms" for m in args.methods),
              flush=True)
    peak = PEAK_BF16.get(jax.devices()[0].device_kind)
    for m in args.methods:
        dt = float(np.median(times[m]))
        tok_s = batch * seq / dt
        mfu = runs[m]["flops"] * tok_s / peak if peak else None
        payload["rows"].append(dict(method=m, preset=preset, params=runs[m]["n_params"], batch=batch, seq=seq,
                                    step_ms=dt * 1e3, step_ms_rounds=[t * 1e3 for t in times[m]],
                                    tokens_per_s=tok_s, mfu=mfu, remat=runs[m]["remat"],
                                    temp_bytes=runs[m]["temp_bytes"],
                                    final_loss=float(runs[m]["state"]["metrics"]["loss"])))
        print(f"{m:8s} {preset} ({runs[m]['n_params'] / 1e6:.1f}M) B{batch} S{seq}: {dt * 1e3:.1f} ms/step "
              f"(median of {rounds}), {tok_s:,.0f} tokens/s" + (f", MFU {mfu:.1%}" if mfu else "")
              + (f", XLA temp {runs[m]['temp_bytes'] / 2**30:.2f} GiB" if runs[m]["temp_bytes"] is not None else ""))
    payload["vs_dense_rounds"] = ratios_to_dense(times)
    payload["vs_dense"] = {m: float(np.median(r)) for m, r in payload["vs_dense_rounds"].items()}
    payload["sage_vs_dense"] = payload["vs_dense"].get("sage")
    write_json("training_smoke" if args.smoke else ("training" if preset == "50m" else f"training_{preset}"), payload)
    print("tokens/s relative to dense (median of per-round ratios): "
          + ", ".join(f"{m} {r:.2f}" for m, r in payload["vs_dense"].items()))
    np.testing.assert_(all(np.isfinite(r["final_loss"]) for r in payload["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
