"""The fused dQ's scheduling knobs at head dim 128, timed against each other and cuDNN bf16 on the GPU.

Usage (GPU machine, repo root)::

    PYTHONPATH=. python benchmarks/dq_schedule.py            # checks + fwd+bwd times
    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. python benchmarks/dq_schedule.py --smoke
        # tiny shapes in the Mosaic GPU interpreter, which needs the threads of 8 host devices (checks the script)

The knobs (scheduling only; the values are the same): ``SageFwdConfig.split_dq_schedule`` (the split dQ's products
after dK's, or before it with its stage store and TMA reduce-add issued while dK's product runs) and
``dq_stage_order`` of both methods (the float32 stage's columns in ``dq_stage``'s conflict-free order). Per shape,
every variant's gradients against the library default's (rel-L1; a variant that differs is not timed) and the
default's against the xla reference, then one jitted fwd+bwd of each variant and of cuDNN in interleaved rounds.
Writes benchmarks/results/dq_schedule.json (and $OUT/dq_schedule.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax

import lowbit_jax as lb
from benchmarks.attention import make_inputs
from benchmarks.common import ROUND_WARMUP, ROUNDS, environment, fwd_bwd, time_rounds, write_json

#: config fields per variant; "default" is the library's config for the device
VARIANTS = {
    "sage": {"default": {}, "under_dk": dict(split_dq_schedule="under_dk"),
             "permuted": dict(dq_stage_order="permuted"),
             "under_dk+permuted": dict(split_dq_schedule="under_dk", dq_stage_order="permuted")},
    "qat": {"default": {}, "permuted": dict(dq_stage_order="permuted")},
}
#: (method, B, H, S, D, causal)
SHAPES = [("sage", 4, 32, 4096, 128, False), ("sage", 4, 32, 4096, 128, True), ("sage", 1, 32, 16384, 128, False),
          ("sage", 1, 32, 16384, 128, True), ("qat", 4, 32, 4096, 128, False), ("qat", 4, 32, 4096, 128, True)]
SMOKE_SHAPES = [("sage", 1, 2, 256, 128, True), ("qat", 1, 2, 256, 128, False)]
#: largest rel-L1 of a variant's gradients against the default's (same dŜ codes, another float32 summation order)
SAME_VALUES = 1e-3


def attention(method: str, d: int, causal: bool, knobs: dict, smoke: bool):
    """f(q, k, v) → o: ``method`` with the device's config, its fused dQ on Mosaic GPU, ``knobs`` applied."""
    extra = dict(implementation="pallas", interpret=True) if smoke else {}
    if method == "sage":
        cfg = dataclasses.replace(lb.sage_fwd_config(d, causal), dkdv_backend="mosaic", dq_kernel="fused", **knobs)
        return functools.partial(lb.sage_attention, causal=causal, config=cfg, **extra)
    cfg = dataclasses.replace(lb.qat_config(d, causal), bwd_backend="mosaic", dq_kernel="fused", **knobs)
    return functools.partial(lb.qat_attention, causal=causal, config=cfg, **extra)


def run_shape(method: str, b: int, h: int, s: int, d: int, causal: bool, *, smoke: bool, rounds: int, log) -> dict:
    q, k, v = make_inputs(jax.random.key(3), b, h, s, d)
    do = jax.random.normal(jax.random.key(4), q.shape, q.dtype)
    fns = {name: fwd_bwd(attention(method, d, causal, knobs, smoke)) for name, knobs in VARIANTS[method].items()}
    got = {name: fn(q, k, v, do) for name, fn in fns.items()}
    xla = fwd_bwd(functools.partial(getattr(lb, f"{method}_attention"), causal=causal, implementation="xla"))
    row = dict(method=method, shape=[b, h, s, d, causal],
               default_vs_xla=[float(lb.rel_l1(a, r)) for a, r in zip(got["default"][1:], xla(q, k, v, do)[1:])],
               grads_vs_default={name: [float(lb.rel_l1(a, r)) for a, r in zip(g[1:], got["default"][1:])]
                                 for name, g in got.items() if name != "default"})
    same = {name for name, errs in row["grads_vs_default"].items() if max(errs) <= SAME_VALUES}
    timed = {name: (fn, (q, k, v, do)) for name, fn in fns.items() if name == "default" or name in same}
    if not smoke:
        cudnn = functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn")
        timed["cudnn_bf16"] = (fwd_bwd(cudnn), (q, k, v, do))
    row["ms"], row["ms_rounds"] = time_rounds(timed, rounds, warmup=ROUND_WARMUP,
                                              **(dict(iters=1, batches=1) if smoke else {}))
    row["speed_vs_default"] = {name: row["ms"]["default"] / t for name, t in row["ms"].items()}
    log(f"{method} B{b} H{h} S{s} D{d} causal={causal}: " + ", ".join(
        f"{name} {t:.3f} ms ({row['speed_vs_default'][name]:.3f}x)" for name, t in row["ms"].items())
        + "; dq/dk/dv rel-L1 vs default " + ", ".join(
            f"{name} {max(errs):.1e}" for name, errs in row["grads_vs_default"].items())
        + (f"; not timed (values differ): {sorted(set(row['grads_vs_default']) - same)}"
           if set(row["grads_vs_default"]) - same else ""))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in the Mosaic GPU interpreter; runs anywhere")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved timing rounds per shape")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.smoke:
        print("benchmarks/dq_schedule.py needs a GPU (or --smoke)")
        return 2
    log = functools.partial(print, flush=True)
    name = "dq_schedule_smoke" if args.smoke else "dq_schedule"
    payload = dict(env=environment(), command="PYTHONPATH=. python benchmarks/dq_schedule.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), rows=[])
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:  # written after each row: a cut-off run keeps its rows
        payload["rows"].append(run_shape(*shape, smoke=args.smoke, rounds=1 if args.smoke else args.rounds, log=log))
        write_json(name, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
