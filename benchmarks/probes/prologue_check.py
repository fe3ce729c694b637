"""SageAttention or Attn-QAT with the fused QK-norm + RoPE prologue against the unfused composition, compiled on
the GPU.

Usage (GPU machine, repo root): ``PYTHONPATH=. python benchmarks/probes/prologue_check.py [--method sage|qat]``.
For each shape it runs ``attention(q, k, v, prologue=…)`` and ``attention(apply(q), apply(k), v)`` (the prologue
by XLA) under one ``jax.vjp``, reports the relative L1 difference of o and of every gradient, and the device busy
time of each (``benchmarks.profiling``). Writes ``$OUT/prologue_check[_qat].json``.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import lowbit_jax as lb
from benchmarks.profiling import profile_calls
from lowbit_jax.formats import qk_prologue

SHAPES = [(16, 10, 5, 2048, 64, True), (4, 32, 32, 4096, 128, False)]


def rel(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.sum(jnp.abs(a - b)) / jnp.sum(jnp.abs(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--method", choices=("sage", "qat"), default="sage")
    args = ap.parse_args()
    attention = lb.sage_attention if args.method == "sage" else lb.qat_attention
    rows = []
    for b, hq, hkv, s, d, causal in SHAPES:
        ks = jax.random.split(jax.random.key(0), 6)
        q = (2 * jax.random.normal(ks[0], (b, s, hq, d))).astype(jnp.bfloat16)
        k = (2 * jax.random.normal(ks[1], (b, s, hkv, d)) + 0.5).astype(jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, s, hkv, d)).astype(jnp.bfloat16)
        do = jax.random.normal(ks[3], (b, s, hq, d)).astype(jnp.bfloat16)
        g = (1 + 0.2 * jax.random.normal(ks[4], (2, d))).astype(jnp.bfloat16)
        cos, sin = lb.rope_tables(jnp.arange(s), d)

        def fused(q, k, v, gq, gk):
            pro = lb.QKPrologue(gq, gk, cos, sin, cos, sin)
            return attention(q, k, v, causal=causal, prologue=pro)

        def unfused(q, k, v, gq, gk):
            qz = qk_prologue.apply(q, gq, cos, sin, eps=1e-6)
            kz = qk_prologue.apply(k, gk, cos, sin, eps=1e-6)
            return attention(qz, kz, v, causal=causal)

        outs, times = {}, {}
        for name, fn in (("fused", fused), ("unfused", unfused)):
            step = jax.jit(lambda q, k, v, gq, gk, do, fn=fn: (lambda o, vjp: (o, *vjp(do)))(
                *jax.vjp(fn, q, k, v, gq, gk)))
            outs[name] = jax.block_until_ready(step(q, k, v, g[0], g[1], do))
            prof = profile_calls(lambda: jax.block_until_ready(step(q, k, v, g[0], g[1], do)), 5)
            times[name] = dict(busy_ms=prof["busy_ms"], top=[(n[:60], ms) for n, (ms, _) in
                                                             list(prof["kernels"].items())[:12]])
        diffs = {n: rel(a, r) for n, a, r in zip(("o", "dq", "dk", "dv", "dgq", "dgk"), outs["fused"], outs["unfused"])}
        row = dict(shape=[b, hq, hkv, s, d, causal], rel_l1_fused_vs_unfused=diffs, **times)
        print(json.dumps(row), flush=True)
        rows.append(row)
    name = "prologue_check.json" if args.method == "sage" else f"prologue_check_{args.method}.json"
    with open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w") as f:
        json.dump(dict(device=str(jax.devices()[0].device_kind), method=args.method, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
