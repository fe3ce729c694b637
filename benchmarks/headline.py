"""The headline table: each method against cuDNN's bf16 attention at the shapes the README reports.

Usage (GPU machine, repo root)::

    PYTHONPATH=. python benchmarks/headline.py [--name headline] [--rounds 3] [--quick]

SageAttention and Attn-QAT: the forward (whole op, quantization included) and one jitted fwd+bwd (vjp +
pullback), bf16 inputs, at B4 H32 S4096 D128 and B1 H32 S16384 D128 (causal and not) and B8 H32 S2048 D64,
against ``jax.nn.dot_product_attention(implementation="cudnn")`` timed in the same interleaved rounds (a drift of the
device moves both columns alike). ThriftAttention: one new token over a full cache (GQA 32/8, D128, f = 0.05)
against cuDNN's bf16 decode over the same cache. Accuracy: cos-sim against exact float32 attention of O and the
gradients. Only the public API is used, so the same script times an older checkout (``PYTHONPATH=<tree>``).
Writes ``benchmarks/results/<name>.json``; ``render_results.py`` renders it.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import lowbit_jax as lb
from benchmarks.common import DECODE_CALLS, RESULTS_DIR, environment, keep_other_sections, time_rounds, write_json

#: (B, H, S, D, causal) of the training-op table
SHAPES = [(4, 32, 4096, 128, False), (4, 32, 4096, 128, True), (1, 32, 16384, 128, False),
          (1, 32, 16384, 128, True), (8, 32, 2048, 64, False)]
#: (B, S) of the decode table (GQA 32/8, D128)
DECODE = [(8, 8192), (2, 131072)]
#: what a run measures (``--parts``); a run of some keeps the others from its results file
PARTS = ("training", "decode", "accuracy")


def _inputs(b, h, s, d, hkv=None, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    hkv = hkv or h
    # drawn in float32, then rounded: jax's bfloat16 normal draws take only 128 distinct values, whose rounding
    # errors repeat instead of averaging out (e4m3 P·V measured O 0.995 on them against 0.9993 on these)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    q = normal(keys[0], (b, s, h, d))
    k = normal(keys[1], (b, s, hkv, d))
    v = normal(keys[2], (b, s, hkv, d))
    do = normal(keys[3], (b, s, h, d))
    return q, k, v, do


def _cudnn(q, k, v, *, causal):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def _methods(causal):
    return {"cudnn_bf16": functools.partial(_cudnn, causal=causal),
            "sage": functools.partial(lb.sage_attention, causal=causal),
            "qat": functools.partial(lb.qat_attention, causal=causal)}


def _fwd_bwd(fn):
    def run(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return o, vjp(do)
    return jax.jit(run)


def training_rows(shapes, rounds, log) -> list[dict]:
    rows = []
    for b, h, s, d, causal in shapes:
        q, k, v, do = _inputs(b, h, s, d)
        timed = {}
        for name, fn in _methods(causal).items():
            timed[f"{name} fwd"] = (jax.jit(fn), (q, k, v))
            timed[f"{name} fwd+bwd"] = (_fwd_bwd(fn), (q, k, v, do))
        for fn, args in timed.values():
            jax.block_until_ready(fn(*args))
        ms, _ = time_rounds(timed, rounds, warmup=5)
        row = dict(shape=[b, h, s, d, causal], ms=ms)
        for part in ("fwd", "fwd+bwd"):
            for name in ("sage", "qat"):
                row[f"{name} {part} ratio"] = ms[f"cudnn_bf16 {part}"] / ms[f"{name} {part}"]
        log(f"B{b} H{h} S{s} D{d} causal={causal}: " + ", ".join(
            f"{k} {v:.2f}×" for k, v in row.items() if k.endswith("ratio")))
        rows.append(row)
    return rows


def accuracy(log) -> list[dict]:
    """cos-sim of O and the gradients against exact float32 attention, B1 H8 S4096 D128, N(0,1) and K outliers."""
    out = []
    for inputs in ("normal", "k_outlier"):
        q, k, v, do = _inputs(1, 8, 4096, 128, seed=3)
        if inputs == "k_outlier":
            offset = 10.0 * jax.random.normal(jax.random.PRNGKey(9), (1, 1, 8, 128))
            k = (k.astype(jnp.float32) + offset).astype(k.dtype)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
        exact_o, exact_vjp = jax.vjp(lb.reference_attention, *f32[:3])
        exact = (exact_o, *exact_vjp(f32[3]))
        for name, fn in _methods(False).items():
            o, vjp = jax.vjp(fn, q, k, v)
            got = (o, *vjp(do))
            row = dict(inputs=inputs, method=name, **{f"cos {n}": float(lb.cos_sim(g, e))
                                                       for n, g, e in zip(("O", "dQ", "dK", "dV"), got, exact)})
            log(f"accuracy {inputs} {name}: "
                + ", ".join(f"{k} {v:.5f}" for k, v in row.items() if k.startswith("cos")))
            out.append(row)
    return out


def decode_rows(shapes, rounds, log) -> list[dict]:
    rows = []
    for b, s in shapes:
        keys = jax.random.split(jax.random.PRNGKey(1), 3)
        k = jax.random.normal(keys[0], (b, s, 8, 128), jnp.bfloat16)
        v = jax.random.normal(keys[1], (b, s, 8, 128), jnp.bfloat16)
        q1 = jax.random.normal(keys[2], (b, 1, 32, 128), jnp.bfloat16)
        cache = lb.ThriftKVCache.create(b, s, 8, 128).append(k, v)
        lengths = jnp.full((b,), s, jnp.int32)
        timed = {
            "cudnn_bf16": (jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
                q, k, v, key_value_seq_lengths=n, implementation="cudnn")), (q1, k, v, lengths)),
            "thrift f=0.05": (jax.jit(lambda q, c: lb.thrift_decode(q, c, budget=0.05)), (q1, cache)),
        }
        for fn, args in timed.values():
            jax.block_until_ready(fn(*args))
        ms, _ = time_rounds(timed, rounds, calls=DECODE_CALLS, warmup=5)  # one step a dispatch would time the host
        row = dict(shape=[b, s], ms=ms, calls_per_dispatch=DECODE_CALLS,
                   ratio=ms["cudnn_bf16"] / ms["thrift f=0.05"])
        log(f"decode B{b} S{s}: cuDNN {ms['cudnn_bf16']:.3f} ms, thrift {ms['thrift f=0.05']:.3f} ms "
            f"({row['ratio']:.2f}×)")
        rows.append(row)
        del cache
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="headline", help="results file name")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per row")
    parser.add_argument("--quick", action="store_true", help="the first and last training shapes, one decode shape")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                        help="the parts to run; the others are kept from the results file")
    args = parser.parse_args(argv)
    log = functools.partial(print, flush=True)
    env = environment()
    log(f"{env['device']}, jax {env['jax']}, {env['date']}")
    shapes = [SHAPES[0], SHAPES[-1]] if args.quick else SHAPES
    payload = dict(env=env, command="PYTHONPATH=. python benchmarks/headline.py " + " ".join(argv or sys.argv[1:]))
    payload = keep_other_sections(payload, RESULTS_DIR / f"{args.name}.json", args.parts, PARTS)
    parts = {"training": lambda: training_rows(shapes, args.rounds, log),
             "decode": lambda: decode_rows(DECODE[:1] if args.quick else DECODE, args.rounds, log),
             "accuracy": lambda: accuracy(log)}
    for part in args.parts:
        payload[part] = parts[part]()
        write_json(args.name, payload)  # after each part, so a run cut short keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
