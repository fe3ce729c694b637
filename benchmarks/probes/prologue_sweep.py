"""Launch parameters of the prologue kernels.

Usage (GPU machine, repo root): ``PYTHONPATH=. python benchmarks/probes/prologue_sweep.py [--part sage|qat]``.
Times (device busy, ``benchmarks.profiling``):

* ``--part sage`` (default), at the 50m model's attention shape (B16 S2048 Hq10 Hkv5 D64): the backward pass
  ``qk_prologue_bwd`` over rows per program and warps, and SageAttention's quantize kernels with the prologue
  over warps. Writes ``$OUT/prologue_sweep.json``.
* ``--part qat``, at that shape and at B4 S4096 H32 D128: ``qk_prologue_bwd`` over rows and warps, and Attn-QAT's
  fake quantization (``fp4_fake_quant_heads``) with and without the prologue over rows and warps. Writes
  ``$OUT/prologue_sweep_qat.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import lowbit_jax as lb
from benchmarks.profiling import profile_calls
from pallas_kernels import quantize
from pallas_kernels.fake_quant import fp4_fake_quant_heads
from pallas_kernels.qk_prologue import qk_prologue_bwd


def busy(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    return profile_calls(lambda: jax.block_until_ready(fn(*args)), 10)["busy_ms"]


def qat_part() -> list[dict]:
    rows = []
    for b, s, hq, d in ((16, 2048, 10, 64), (4, 4096, 32, 128)):
        x = jax.random.normal(jax.random.key(0), (b, s, hq, d), jnp.bfloat16)
        g = jnp.ones((d,), jnp.bfloat16)
        cos, sin = lb.rope_tables(jnp.arange(s), d)
        pro = lb.QKPrologue(g, g, cos, sin, cos, sin)
        shape = f"B{b} S{s} H{hq} D{d}"
        for block in (32, 64, 128):
            for warps in (1, 2, 4, 8):
                fn = jax.jit(lambda x, dz, block=block, warps=warps: qk_prologue_bwd(
                    x, dz, g, cos, sin, eps=1e-6, block=block, num_warps=warps))
                rows.append(dict(kernel="qk_prologue_bwd", shape=shape, block=block, warps=warps, ms=busy(fn, x, x)))
                print(rows[-1], flush=True)
        for name, p in (("with", pro), ("without", None)):
            for block in (64, 128):
                for warps in (2, 4, 8, 16):
                    fn = jax.jit(lambda x, p=p, bl=block, w=warps: fp4_fake_quant_heads(
                        x, p, "k", seq_pad=s, block=bl, out_dtype=jnp.bfloat16, lane_order=True, num_warps=w))
                    rows.append(dict(kernel=f"fp4_fake_quant {name} prologue", shape=shape, block=block, warps=warps,
                                     ms=busy(fn, x)))
                    print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("sage", "qat"), default="sage")
    if ap.parse_args().part == "qat":
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "prologue_sweep_qat.json"), "w") as f:
            json.dump(qat_part(), f, indent=1)
        return
    b, s, hq, hkv, d = 16, 2048, 10, 5, 64
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, s, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.bfloat16)
    g = jnp.ones((d,), jnp.bfloat16)
    cos, sin = lb.rope_tables(jnp.arange(s), d)
    pro = lb.QKPrologue(g, g, cos, sin, cos, sin)
    rows = []
    for block in (64, 128, 256):
        for warps in (2, 4, 8):
            fn = jax.jit(lambda x, dz, block=block, warps=warps: qk_prologue_bwd(
                x, dz, g, cos, sin, eps=1e-6, block=block, num_warps=warps))
            rows.append(dict(kernel="qk_prologue_bwd q", block=block, warps=warps, ms=busy(fn, q, q)))
            print(rows[-1], flush=True)
    for warps in (2, 4, 8):
        for name, p in (("with", pro), ("without", None)):
            fq = jax.jit(lambda q, p=p, w=warps: quantize.sage_quantize_q(
                q, p, block=64, per_block=True, smooth_block=False, out_scale=0.18, transposed=True,
                t_operand_order=True, num_warps=w))
            fs = jax.jit(lambda k, v, p=p, w=warps: quantize.sage_channel_stats(k, v, p, smooth_k=True, num_warps=w))
            km, vs = fs(k, v)
            fk = jax.jit(lambda k, v, km, vs, p=p, w=warps: quantize.sage_quantize_kv(
                k, v, km, vs, p, block=128, per_block=True, transposed=True, v_operand_order=True, num_warps=w))
            rows.append(dict(kernel=f"quantize {name} prologue", warps=warps, q_ms=busy(fq, q),
                             stats_ms=busy(fs, k, v), kv_ms=busy(fk, k, v, km, vs)))
            print(rows[-1], flush=True)
    for chunk in (32, 64, 128, 256):  # sage_channel_stats' tokens per program, with the prologue
        for warps in (1, 2, 4, 8):
            fs = jax.jit(lambda k, v, c=chunk, w=warps: quantize.sage_channel_stats(k, v, pro, smooth_k=True, chunk=c,
                                                                                  num_warps=w))
            rows.append(dict(kernel="channel_stats with prologue", chunk=chunk, warps=warps, ms=busy(fs, k, v)))
            print(rows[-1], flush=True)
    km, vs = quantize.sage_channel_stats(k, v, pro, smooth_k=True)
    for block in (64, 128):  # K's quantization block is the config's block_k (128 at D64): 64 only for reference
        for warps in (2, 4, 8, 16):
            fk = jax.jit(lambda k, v, km, vs, bl=block, w=warps: quantize.sage_quantize_kv(
                k, v, km, vs, pro, block=bl, per_block=True, transposed=True, v_operand_order=True, num_warps=w))
            rows.append(dict(kernel="quantize_kv with prologue", block=block, warps=warps, ms=busy(fk, k, v, km, vs)))
            print(rows[-1], flush=True)
    for warps in (8, 16):
        fq = jax.jit(lambda q, w=warps: quantize.sage_quantize_q(
            q, pro, block=64, per_block=True, smooth_block=False, out_scale=0.18, transposed=True,
            t_operand_order=True, num_warps=w))
        rows.append(dict(kernel="quantize_q with prologue", warps=warps, ms=busy(fq, q)))
        print(rows[-1], flush=True)
    for block in (32, 64):
        for warps in (1, 2):
            fn = jax.jit(lambda x, dz, block=block, warps=warps: qk_prologue_bwd(
                x, dz, g, cos, sin, eps=1e-6, block=block, num_warps=warps))
            rows.append(dict(kernel="qk_prologue_bwd k", block=block, warps=warps, ms=busy(fn, k, k)))
            print(rows[-1], flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "prologue_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
