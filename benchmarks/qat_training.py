"""Training comparison: one model trained with 16-bit attention, FP4 forward + naive backward, and Attn-QAT.

Usage (repo root):
    PYTHONPATH=. python benchmarks/qat_training.py                    # GPU: preset small, seq 512
    PYTHONPATH=. python benchmarks/qat_training.py --smoke            # tiny, a few steps, any backend

Same data, seed, initialization and schedule for the three runs; each run's
train/validation losses go to one PNG (benchmarks/results/qat_training.png) and a
JSON summary (final losses, and the step a run diverged at, if it did).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

from benchmarks.common import RESULTS_DIR, copy_to_out, environment, write_json
from train.loop import TrainConfig, TrainingDiverged, train

warnings.filterwarnings("ignore", category=DeprecationWarning)

VARIANTS = [("16-bit (cuDNN/XLA)", dict(method="dense")),
            ("FP4 fwd + naive bwd", dict(method="qat_fp4", naive_backward=True)),
            ("Attn-QAT", dict(method="qat_fp4"))]


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, axv) = plt.subplots(1, 2, figsize=(11, 4))
    for label, res in results.items():
        recs = res["records"]
        line, = ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], lw=0.8, label=label)
        val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
        if val:
            axv.plot(*zip(*val), "o-", color=line.get_color(), label=label)
        if res.get("diverged_at"):
            ax.axvline(res["diverged_at"], color=line.get_color(), ls=":")
    for a, name in ((ax, "train loss"), (axv, "validation loss")):
        a.set_xlabel("step")
        a.set_ylabel(f"{name} (nats/byte)")
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--name", default="qat_training", help="results file name (JSON and PNG)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.seq, args.batch, args.steps = "tiny", 64, 4, 4
    common = dict(preset=args.preset, seq=args.seq, batch=args.batch, steps=args.steps, lr=args.lr,
                  eval_every=max(1, args.steps // 10), eval_batches=4, ckpt_every=args.steps, max_corpus_mb=16,
                  seed=0, warmup=max(1, args.steps // 20))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, over in VARIANTS:
            out = Path(tmp) / over["method"] / str(over.get("naive_backward", False))
            cfg = TrainConfig(out=str(out), **common, **over)
            res = dict(config=over)
            try:
                summary = train(cfg, log=lambda m: print(f"[{label}] {m}", flush=True))
                res.update(final_loss=summary["loss"], final_val_loss=summary["val_loss"],
                           tokens_per_s=summary["tokens_per_s"])
            except TrainingDiverged as e:
                print(f"[{label}] diverged: {e}", flush=True)
                res["diverged"] = str(e)
            records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
            res["records"] = records
            if "diverged" in res:
                res["diverged_at"] = (records[-1]["step"] + 1) if records else 1
            results[label] = res
    title = f"{args.preset} model, seq {args.seq}, batch {args.batch}, lr {args.lr}"
    name = args.name + ("_smoke" if args.smoke else "")
    png = RESULTS_DIR / f"{name}.png"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot(results, png, title)
    copy_to_out(png)
    summary = {k: {kk: vv for kk, vv in v.items() if kk != "records"} for k, v in results.items()}
    for label, s in summary.items():
        print(f"{label:22s} " + (f"final train {s['final_loss']:.4f} val {s['final_val_loss']:.4f}"
                                 if "final_loss" in s else f"DIVERGED at step {s['diverged_at']}"))
    write_json(name, dict(env=environment(), title=title, plot=str(png.relative_to(RESULTS_DIR.parent.parent)),
                          command="PYTHONPATH=. python benchmarks/qat_training.py " + " ".join(
                              argv if argv is not None else sys.argv[1:]), summary=summary,
                          curves={k: [(r["step"], r["loss"], r.get("val_loss")) for r in v["records"]]
                                  for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
