"""Data-parallel training on several GPUs: the N-device step against the one-device step, and its throughput.

Usage (a machine with 2 or more GPUs, repo root):
    PYTHONPATH=. python benchmarks/data_parallel.py                 # all devices, dense and sage
    PYTHONPATH=. python benchmarks/data_parallel.py --smoke         # tiny model; on the CPU give it devices:
        XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. python benchmarks/data_parallel.py --smoke

Two parts, per attention method, with the real kernels inside ``jax.shard_map`` (``train.parallel``):

1. Agreement. The same initial parameters and the same global batches run ``--check-steps`` steps on one
   device and on N devices. Reported per step: the loss and gradient norm of both runs, and after the last
   step the relative L2 difference of the parameter *updates* (p − p₀). A second one-device run gives the
   noise floor: atomics in the backward kernels (cuDNN's and the fused SageBwd dQ's TMA reduce-add) make
   even one device not bit-reproducible, so N devices are judged against that floor, not against zero.
2. Throughput, weak scaling: ``--batch`` sequences per device (preset 50m, S2048), tokens/s on one device
   and on N devices, in interleaved rounds; scaling efficiency = tokens/s(N) / (N × tokens/s(1)).

Writes benchmarks/results/data_parallel.json (and $OUT/data_parallel.json).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.common import environment, write_json
from train.data import PackedBatches, load_corpus
from train.loop import TrainConfig, build
from train.parallel import batch_sharding

warnings.filterwarnings("ignore", category=DeprecationWarning)


_BUILT: dict = {}


def _setup(method: str, preset: str, seq: int, batch: int, devices: int, steps: int) -> dict:
    """A train step on ``devices`` devices (built once per configuration, then reused) with fresh copies of
    the initial parameters and optimizer state placed on its mesh (the step donates them)."""
    key = (method, preset, seq, batch, devices, steps)
    if key not in _BUILT:
        b = build(TrainConfig(preset=preset, method=method, batch=batch, seq=seq, steps=steps, warmup=1,
                              devices=devices, max_corpus_mb=8).resolved())
        _BUILT[key] = (b, jax.tree.map(np.asarray, b["params"]))
    b, p0 = _BUILT[key]
    replicated = NamedSharding(b["mesh"], P())
    params = jax.device_put(p0, replicated)
    return dict(b=b, params=params, opt_state=jax.device_put(b["tx"].init(params), replicated), p0=p0)


def _run_steps(s: dict, batches: list[np.ndarray]) -> list[dict]:
    """Run the steps in place; per step the loss and gradient norm as floats."""
    shard = batch_sharding(s["b"]["mesh"])
    out = []
    for tokens in batches:
        s["params"], s["opt_state"], m = s["b"]["train_step"](s["params"], s["opt_state"],
                                                             jax.device_put(tokens, shard))
        out.append({k: float(v) for k, v in m.items()})
    return out


def _update_difference(a: dict, b: dict) -> float:
    """‖(p_a − p₀) − (p_b − p₀)‖ / ‖p_a − p₀‖ over all parameters (float64 on the host)."""
    num = den = 0.0
    for pa, pb, p0 in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"]), jax.tree.leaves(a["p0"])):
        pa, pb, p0 = (np.asarray(x, np.float64) for x in (pa, pb, p0))
        num += float(np.sum((pa - pb) ** 2))
        den += float(np.sum((pa - p0) ** 2))
    return float(np.sqrt(num / den)) if den else float("nan")


def agreement(method: str, preset: str, seq: int, batch: int, n: int, steps: int, data: PackedBatches,
              schedule_steps: int) -> dict:
    """One device (twice) and ``n`` devices on the same global batches from the same start."""
    batches = [data.batch(i) for i in range(steps)]
    runs = {name: _setup(method, preset, seq, batch, devices, schedule_steps)
            for name, devices in (("one", 1), ("one_again", 1), ("many", n))}
    logs = {name: _run_steps(s, batches) for name, s in runs.items()}

    def worst(metric: str, other: str) -> float:  # largest relative difference from the first 1-device run
        return max(abs(a[metric] - b[metric]) / max(abs(a[metric]), 1e-30) for a, b in zip(logs["one"], logs[other]))

    row = dict(method=method, devices=n, global_batch=batch, steps=steps)
    for metric in ("loss", "grad_norm"):
        row.update({f"{metric}_one": [m[metric] for m in logs["one"]],
                    f"{metric}_many": [m[metric] for m in logs["many"]],
                    f"{metric}_rel_diff": worst(metric, "many"),
                    f"{metric}_rel_diff_noise": worst(metric, "one_again")})
    row.update(update_rel_diff=_update_difference(runs["one"], runs["many"]),
               update_rel_diff_noise=_update_difference(runs["one"], runs["one_again"]))
    print(f"  agreement {method} 1 vs {n} devices, global batch {batch}, {steps} steps: loss "
          f"{row['loss_rel_diff']:.1e} (1 vs 1: {row['loss_rel_diff_noise']:.1e}), grad norm "
          f"{row['grad_norm_rel_diff']:.1e} ({row['grad_norm_rel_diff_noise']:.1e}), parameter updates "
          f"{row['update_rel_diff']:.1e} ({row['update_rel_diff_noise']:.1e})", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, short runs; any backend")
    parser.add_argument("--methods", nargs="+", default=["dense", "sage"])
    parser.add_argument("--devices", type=int, default=None, help="N (default: all local devices)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per device in the throughput part")
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed window")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    n = args.devices or len(jax.devices())
    if n < 2:
        print(f"benchmarks/data_parallel.py needs 2 or more devices, found {len(jax.devices())}")
        return 2
    if jax.default_backend() != "gpu" and not args.smoke:
        print("benchmarks/data_parallel.py needs GPUs (or --smoke)")
        return 2
    preset, seq, per_device = ("tiny", 64, 2) if args.smoke else ("50m", 2048, args.batch)
    steps, rounds = (2, 2) if args.smoke else (args.steps, args.rounds)
    corpus = load_corpus(None, 8 * 2**20)  # read once: both parts pack their batches from it
    data = PackedBatches(corpus, seq, per_device * n, 1, 0)
    schedule = steps * (rounds + 1)  # TrainConfig.steps of every build, so that builds are shared
    payload = dict(env=environment(), devices=n, device_kinds=sorted({d.device_kind for d in jax.devices()[:n]}),
                   command="PYTHONPATH=. python benchmarks/data_parallel.py " + " ".join(
                       argv if argv is not None else sys.argv[1:]),
                   preset=preset, seq=seq, agreement=[], throughput=[], rounds=rounds, steps_per_round=steps)
    for method in args.methods:
        payload["agreement"].append(agreement(method, preset, seq, per_device * n, n, args.check_steps, data,
                                              schedule))

    timed = {}
    for method in args.methods:
        for devices in (1, n):
            batch = per_device * devices
            s = _setup(method, preset, seq, batch, devices, schedule)
            shard = batch_sharding(s["b"]["mesh"])
            feed = PackedBatches(corpus, seq, batch, 1, 0)
            s["batches"] = [jax.device_put(feed.batch(i), shard) for i in range(steps)]
            timed[(method, devices)] = s
    times = {key: [] for key in timed}
    for _ in range(rounds + 1):  # the first round compiles and warms up; it is dropped
        for key, s in timed.items():
            t0 = time.perf_counter()
            for tokens in s["batches"]:
                s["params"], s["opt_state"], m = s["b"]["train_step"](s["params"], s["opt_state"], tokens)
            jax.block_until_ready(m)
            times[key].append((time.perf_counter() - t0) / steps)
    for method in args.methods:
        one, many = (float(np.median(times[(method, d)][1:])) for d in (1, n))
        tok1, tokn = per_device * seq / one, per_device * n * seq / many
        row = dict(method=method, per_device_batch=per_device, seq=seq, step_ms_one=one * 1e3,
                   step_ms_many=many * 1e3, tokens_per_s_one=tok1, tokens_per_s_many=tokn,
                   efficiency=tokn / (n * tok1), step_ms_rounds_one=[t * 1e3 for t in times[(method, 1)][1:]],
                   step_ms_rounds_many=[t * 1e3 for t in times[(method, n)][1:]])
        payload["throughput"].append(row)
        print(f"{method:6s} {preset} S{seq}, {per_device} sequences per device: 1 device {one * 1e3:.1f} ms/step "
              f"{tok1:,.0f} tokens/s; {n} devices {many * 1e3:.1f} ms/step {tokn:,.0f} tokens/s; "
              f"scaling efficiency {row['efficiency']:.2f}", flush=True)
    write_json("data_parallel_smoke" if args.smoke else "data_parallel", payload)
    finite = all(np.isfinite(r["loss_many"]).all() and np.isfinite(r["loss_one"]).all() for r in payload["agreement"])
    if not finite:
        print("non-finite loss in the agreement runs")
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
