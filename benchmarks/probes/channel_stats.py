"""Probe: K's token mean and V's per-channel |max| from one Pallas-Triton pass
(``pallas_kernels.quantize.sage_channel_stats``, at several chunk sizes and warp counts) against XLA's two column
reductions (``sage_reference.channel_stats``).

    PYTHONPATH=. python benchmarks/probes/channel_stats.py            # GPU: values and profiled times
    PYTHONPATH=. python benchmarks/probes/channel_stats.py --interpret  # CPU: values only
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from lowbit_jax.sage_reference import channel_stats
from pallas_kernels.quantize import sage_channel_stats


@jax.jit
def xla_stats(k, v):
    return channel_stats(k, v, True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interpret", action="store_true")
    args = ap.parse_args()
    shapes = [(1, 300, 2, 64)] if args.interpret else [(16, 2048, 5, 64), (8, 2048, 32, 64), (4, 4096, 32, 128)]
    out = []
    for shape in shapes:
        kk, kv = jax.random.split(jax.random.PRNGKey(sum(shape)))
        k = (jax.random.normal(kk, shape) + 3.0).astype(jnp.bfloat16)
        v = jax.random.normal(kv, shape).astype(jnp.bfloat16)
        ref_mean, ref_scale = xla_stats(k, v)
        row = dict(shape=shape)
        variants = [(c, w) for c in (128, 256, 512) for w in (4, 8)] if not args.interpret else [(128, 4)]
        for chunk, warps in variants:
            fn = functools.partial(sage_channel_stats, smooth_k=True, chunk=chunk, num_warps=warps,
                                   interpret=args.interpret)
            mean, scale = fn(k, v)
            name = f"triton_c{chunk}_w{warps}"
            row[name] = dict(
                v_scale_equal=bool(np.array_equal(np.asarray(scale), np.asarray(ref_scale))),
                k_mean_max_rel=float(np.max(np.abs(np.asarray(mean) - np.asarray(ref_mean))
                                            / np.maximum(np.abs(np.asarray(ref_mean)), 1e-30))))
            if not args.interpret:
                from benchmarks.profiling import profile_calls
                run = lambda: jax.block_until_ready(fn(k, v))  # noqa: E731
                run(); run()
                p = profile_calls(run, calls=20)
                row[name].update(busy_ms=p["busy_ms"], kernels={n: t for n, (t, _) in p["kernels"].items()})
        if not args.interpret:
            from benchmarks.profiling import profile_calls
            run = lambda: jax.block_until_ready(xla_stats(k, v))  # noqa: E731
            run(); run()
            p = profile_calls(run, calls=20)
            row["xla"] = dict(busy_ms=p["busy_ms"], kernels={n: t for n, (t, _) in p["kernels"].items()})
        print(json.dumps(row, indent=1), flush=True)
        out.append(row)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "channel_stats.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
