"""Probe: K's token mean and V's per-channel |max| from one Pallas-Triton pass (partials per chunk of tokens,
then a tiny XLA reduction) against XLA's two column reductions (``sage_reference.channel_stats``).

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

from lowbit_jax.formats import int8
from lowbit_jax.sage_reference import channel_stats
from pallas_kernels._triton import compiler_params, load_rows, pl, row_mask


def _stats_kernel(k_ref, v_ref, ksum_ref, vmax_ref, *, chunk, seq_len, ragged):
    valid = row_mask(pl.program_id(2) * chunk, chunk, seq_len) if ragged else None
    k = load_rows(k_ref, valid).astype(jnp.float32)
    v = load_rows(v_ref, valid).astype(jnp.float32)
    ksum_ref[...] = jnp.sum(k, axis=0, keepdims=True)
    vmax_ref[...] = jnp.max(jnp.abs(v), axis=0, keepdims=True)


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "interpret"))
def triton_stats(k, v, *, chunk=256, num_warps=4, interpret=False):
    b, s, h, d = k.shape
    nch = pl.cdiv(s, chunk)
    row = pl.BlockSpec((None, chunk, None, d), lambda bi, hi, i: (bi, i, hi, 0))
    part = pl.BlockSpec((None, None, 1, d), lambda bi, hi, i: (bi, hi, i, 0))
    ksum, vmax = pl.pallas_call(
        functools.partial(_stats_kernel, chunk=chunk, seq_len=s, ragged=s % chunk != 0),
        grid=(b, h, nch), in_specs=[row, row], out_specs=[part, part],
        out_shape=[jax.ShapeDtypeStruct((b, h, nch, d), jnp.float32)] * 2,
        compiler_params=compiler_params(num_warps, 1), interpret=interpret, name="sage_channel_stats",
    )(k, v)
    return jnp.sum(ksum, axis=2) / s, int8.scale_from_amax(jnp.max(vmax, axis=2))


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
            fn = functools.partial(triton_stats, chunk=chunk, num_warps=warps, interpret=args.interpret)
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
