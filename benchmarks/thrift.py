"""ThriftAttention benchmark on the GPU: prefill and decode time vs cuDNN / XLA bf16, accuracy vs exact.

Usage (GPU machine, repo root):
    PYTHONPATH=. python benchmarks/thrift.py                 # every section
    PYTHONPATH=. python benchmarks/thrift.py --smoke         # tiny shapes, interpret mode (checks the script)
    PYTHONPATH=. python benchmarks/thrift.py --sections decode accuracy
    PYTHONPATH=. python benchmarks/thrift.py --sections decode_wgs   # the producer decode kernel vs the default

Measures, in one run (bf16 inputs, layout B,S,H,D, GQA 32 query / 8 kv heads, D128):
* ``checks``: compiled kernels vs the xla twin on awkward shapes (selection bit-exact, prefill and decode
  rel-L1);
* ``accuracy``: rel-L2 of O vs exact fp32 at S16384 causal for budgets 0 (uniform NVFP4), 0.05, 0.10, 0.25, 1
  (16-bit) on N(0,1) inputs and on "heavy-hitter" inputs (a few key blocks aligned with the queries, plus
  the first block: where attention concentrates), and the share of the FP4→16-bit gap each budget
  recovers, ``(err_f0 − err_f) / (err_f0 − err_f1)`` (the paper's anchor, docs/spec.md: 89.1% at 5% on real models);
* ``prefill``: the whole op (selection kernel, operand pass, prefill kernel) and its parts vs cuDNN bf16
  flash attention and JAX's Pallas-Triton ``mha`` (bf16), causal and not, per budget (4·B·H·S²·D FLOPs,
  halved if causal);
* ``long``: a 131k-token causal prefill at f = 0.05 vs cuDNN, time and XLA temporary memory;
* ``decode``: one new token per sequence over a full cache (B8 S8192 and B2 S131072): the Thrift decode
  (selection + split-KV kernel + combine) per budget and split count, vs XLA bf16 attention over the 16-bit
  cache; the K/V bytes each reads and the bandwidth that makes; error vs exact;
* ``sweep``: the prefill kernel's warps and stages at f = 0.05;
* ``decode_sweep``: the decode kernel's warps and stages per budget and per query rows per program;
* ``decode_wgs``: the Mosaic decode kernel with 1, 2 or 4 compute warpgroups a CTA (``ThriftConfig.
  decode_compute_wgs``; more than one behind a producer warpgroup), the kernels alone and the whole op, beside cuDNN,
  in interleaved rounds, each output against the one-warpgroup kernel's.
Writes benchmarks/results/thrift.json (and $OUT/thrift.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import lowbit_jax as lb
from benchmarks.common import (DECODE_CALLS, RESULTS_DIR, attention_flops, chained, environment, keep_other_sections,
                               temp_mib, time_fn, time_rounds, write_json)
from lowbit_jax import thrift as thrift_mod
from lowbit_jax import thrift_backends
from lowbit_jax.thrift_reference import decode_selection
from pallas_kernels import thrift_combine

warnings.filterwarnings("ignore", category=DeprecationWarning)

SECTIONS = ("checks", "accuracy", "prefill", "long", "decode", "sweep", "decode_sweep", "decode_wgs")
BUDGETS = (0.0, 0.05, 0.10, 0.25, 1.0)
PREFILL_SHAPES = [(1, 32, 8, 16384, 128, True), (1, 32, 8, 16384, 128, False), (4, 32, 8, 4096, 128, True)]
LONG_SHAPES = [(1, 32, 8, 131072, 128, True), (1, 32, 8, 262144, 128, True)]
#: (B, Hq, Hkv, S, D, new tokens): every variant below
DECODE_SHAPES = [(8, 32, 8, 8192, 128, 1), (8, 32, 8, 32768, 128, 1), (2, 32, 8, 131072, 128, 1)]
#: MHA, head dim 64 and 2–8 new tokens (speculative decoding): the default and the 16-bit path only
DECODE_EXTRA_SHAPES = [(8, 32, 32, 32768, 128, 1), (8, 32, 8, 32768, 64, 1), (8, 32, 8, 32768, 128, 2),
                       (8, 32, 8, 32768, 128, 4), (8, 32, 8, 32768, 128, 8)]
#: (budget, decode_splits, decode_splits_high, decode_backend), None: picked per call (ThriftConfig.for_decode); the
#: first is the library default (its kernel is timed alone too), the second the same with one Triton kernel
DECODE_VARIANTS = [(0.05, None, None, "auto"), (0.05, None, None, "triton"), (0.05, 32, 8, "auto"),
                   (0.05, 64, 16, "auto"), (0.25, None, None, "auto"), (1.0, None, None, "auto"),
                   (0.0, None, None, "auto")]
SMOKE = dict(prefill=[(1, 4, 2, 256, 64, True)], decode=[(1, 4, 2, 256, 64, 1)], accuracy=(1, 4, 2, 512, 64))


def inputs(key, b, hq, hkv, s, d, heavy: bool, dtype=jnp.bfloat16):
    """q (B, S, Hq, D), k, v (B, S, Hkv, D): N(0,1), or with heavy hitters — a direction u shared by every
    query and by the keys of the first block and of 1% of the other blocks (at least 2) of each kv head."""
    kq, kk, kv, ku, kb = jax.random.split(key, 5)
    q = jax.random.normal(kq, (b, s, hq, d), jnp.float32)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.float32)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.float32)
    if heavy:
        u = jax.random.normal(ku, (d,), jnp.float32)
        nb = s // 64
        hot = np.zeros(nb, bool)
        hot[0] = True
        hot[np.asarray(jax.random.choice(kb, nb - 1, (max(2, nb // 100),), replace=False)) + 1] = True
        q = q + 0.6 * u
        k = k + 0.6 * u * jnp.repeat(jnp.asarray(hot, jnp.float32), 64)[None, :, None, None]
    return tuple(x.astype(dtype) for x in (q, k, v))


def exact_attention(q, k, v, causal, heads_per_chunk=8):
    """fp32 exact attention, a few query heads at a time (the (S × S) scores of one chunk fit)."""
    group = q.shape[2] // k.shape[2]
    step = max(group, heads_per_chunk // group * group)
    outs = []
    for h0 in range(0, q.shape[2], step):
        kv = slice(h0 // group, (h0 + step) // group)
        outs.append(jax.jit(functools.partial(lb.reference_attention, causal=causal))(
            q[:, :, h0:h0 + step].astype(jnp.float32), k[:, :, kv].astype(jnp.float32),
            v[:, :, kv].astype(jnp.float32)))
    return jnp.concatenate(outs, axis=2)


def check_kernels(log, smoke):
    impl = dict(implementation="pallas", interpret=True) if smoke else dict(implementation="pallas")
    rows = []
    # the last element: ThriftConfig.prefill_chunk (None: the default; 16: several chunks and a remainder)
    cases = [(2, 100, 77, 4, 2, 64, True, 0.25, None), (1, 300, 700, 8, 2, 128, True, 0.05, None),
             (1, 1000, 1000, 4, 4, 128, False, 0.1, None), (2, 129, 257, 8, 1, 64, False, 1.0, None),
             (1, 3000, 3000, 8, 2, 128, True, 0.05, 16), (2, 2100, 1500, 4, 4, 64, False, 0.1, 16)]
    for b, sq, sk, hq, hkv, d, causal, f, chunk in cases[:1] if smoke else cases:
        q, k, v = inputs(jax.random.PRNGKey(sq + sk), b, hq, hkv, max(sq, sk), d, heavy=False)
        q, k, v = q[:, :sq], k[:, :sk], v[:, :sk]
        kw = dict(causal=causal, budget=f, config=lb.ThriftConfig(**({} if chunk is None else
                                                                     {"prefill_chunk": chunk})))
        row = dict(kind="prefill", case=(b, sq, sk, hq, hkv, d, causal, f) + (() if chunk is None else (chunk,)))
        try:
            sel_p = lb.thrift_select(q, k, **kw, **impl)
            o_p = lb.thrift_attention(q, k, v, **kw, **impl)
        except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"  prefill kernels FAILED {row['case']}: {row['error']}")
            rows.append(row)
            continue
        sel_x = lb.thrift_select(q, k, **kw, implementation="xla")
        o_x = lb.thrift_attention(q, k, v, **kw, implementation="xla")
        row.update(selection_mismatches=int(jnp.sum(sel_p != sel_x)), o=lb.error_metrics(o_p, o_x))
        rows.append(row)
        log(f"  prefill {row['case']}: selection mismatches {row['selection_mismatches']}, "
            f"O rel-L1 vs xla {row['o']['rel_l1']:.1e}")
    for b, n, t, hq, hkv, d, f in [(2, 1000, 1, 8, 2, 128, 0.1), (1, 333, 4, 32, 8, 64, 0.25)][:1 if smoke else 2]:
        q, k, v = inputs(jax.random.PRNGKey(n), b, hq, hkv, n + t, d, heavy=False)
        cache = lb.ThriftKVCache.create(b, n + t + 64, hkv, d).append(k[:, :n], v[:, :n])
        cache = cache.append(k[:, n:], v[:, n:])
        row = dict(kind="decode", case=(b, n, t, hq, hkv, d, f))
        try:
            o_p = lb.thrift_decode(q[:, n:], cache, budget=f, **impl)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"  decode kernel FAILED {row['case']}: {row['error']}")
            rows.append(row)
            continue
        o_x = lb.thrift_decode(q[:, n:], cache, budget=f, implementation="xla")
        row["o"] = lb.error_metrics(o_p, o_x)
        rows.append(row)
        log(f"  decode {row['case']}: O rel-L1 vs xla {row['o']['rel_l1']:.1e}")
    return rows


def accuracy(log, smoke):
    b, hq, hkv, s, d = SMOKE["accuracy"] if smoke else (1, 32, 8, 16384, 128)
    impl = dict(implementation="pallas", interpret=True) if smoke else {}
    rows = []
    for heavy in (False, True):
        q, k, v = inputs(jax.random.PRNGKey(21), b, hq, hkv, s, d, heavy=heavy)
        exact = exact_attention(q, k, v, True)
        errs = {}
        for f in BUDGETS:
            o = lb.thrift_attention(q, k, v, causal=True, budget=f, **impl)
            errs[f] = lb.error_metrics(o, exact)
        gap = errs[0.0]["rel_l2"] - errs[1.0]["rel_l2"]
        for f in BUDGETS:
            recovered = (errs[0.0]["rel_l2"] - errs[f]["rel_l2"]) / gap if gap > 0 else None
            rows.append(dict(b=b, hq=hq, hkv=hkv, s=s, d=d, causal=True, inputs="heavy" if heavy else "normal",
                             budget=f, metrics=errs[f], gap_recovered=recovered))
            log(f"  accuracy {'heavy' if heavy else 'normal':6s} f={f:.2f}: rel-L2 {errs[f]['rel_l2']:.4f} "
                f"cos {errs[f]['cos_sim']:.5f}" + (f" gap recovered {recovered:.1%}" if recovered is not None else ""))
    return rows


def prefill(log, smoke):
    rows = []
    impl = dict(implementation="pallas", interpret=True) if smoke else {}
    for b, hq, hkv, s, d, causal in SMOKE["prefill"] if smoke else PREFILL_SHAPES:
        q, k, v = inputs(jax.random.PRNGKey(3), b, hq, hkv, s, d, heavy=False)
        flops = attention_flops(b, hq, s, s, d, causal)
        iters = 3 if smoke else 10
        row = dict(b=b, hq=hq, hkv=hkv, s=s, d=d, causal=causal, ms={}, parts_ms={}, errors={})
        if not smoke:
            cudnn = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn"))
            row["ms"]["cudnn_bf16"] = time_fn(cudnn, q, k, v, warmup=2, iters=iters, batches=3)
            try:  # JAX's own Pallas-Triton flash attention (MHA only: K and V repeated to the query heads)
                from jax.experimental.pallas.ops.gpu import attention as pallas_attention

                mha = jax.jit(functools.partial(pallas_attention.mha, segment_ids=None, sm_scale=d**-0.5,
                                                causal=causal))
                kr, vr = (jnp.repeat(x, hq // hkv, axis=2) for x in (k, v))
                row["ms"]["pallas_mha_bf16"] = time_fn(mha, q, kr, vr, warmup=2, iters=iters, batches=3)
            except Exception as e:  # noqa: BLE001
                row["errors"]["pallas_mha_bf16"] = f"{type(e).__name__}: {str(e)[:300]}"
        for f in BUDGETS:
            name = f"thrift_f{f:g}"
            try:
                fn = jax.jit(functools.partial(lb.thrift_attention, causal=causal, budget=f, **impl))
                row["ms"][name] = time_fn(fn, q, k, v, warmup=1, iters=iters, batches=3)
                if f == 0.05:
                    row["parts_ms"] = prefill_parts(q, k, v, causal, f, impl, iters)
            except Exception as e:  # noqa: BLE001
                row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"  {name} failed: {row['errors'][name]}")
        row["tflops"] = {m: flops / t / 1e9 for m, t in row["ms"].items()}
        base = row["ms"].get("cudnn_bf16")
        row["vs_cudnn_bf16"] = {m: base / t for m, t in row["ms"].items()} if base else {}
        rows.append(row)
        log(f"  prefill B{b} H{hq}/{hkv} S{s} D{d} causal={causal}: " + " ".join(
            f"{m} {t:.2f} ms" for m, t in row["ms"].items()) + " | parts at f=0.05: " + " ".join(
            f"{m} {t:.2f}" for m, t in row["parts_ms"].items()))
    return rows


def long_prefill(log, smoke):
    """Causal prefills of 131k and 262k tokens at f = 0.05 against cuDNN: time and XLA temporary memory, with the
    default ``prefill_chunk`` and with all query blocks in one call (``one_call``: the (S/64)² selection and order)."""
    rows = []
    for b, hq, hkv, s, d, causal in SMOKE["prefill"] if smoke else LONG_SHAPES:
        q, k, v = inputs(jax.random.PRNGKey(2), b, hq, hkv, s, d, heavy=False)
        impl = dict(implementation="pallas", interpret=True) if smoke else {}
        thrift = lambda **cfg: jax.jit(functools.partial(  # noqa: E731
            lb.thrift_attention, causal=causal, budget=0.05, config=lb.ThriftConfig(**cfg), **impl))
        fns = {"thrift_f0.05": thrift(), "thrift_f0.05_one_call": thrift(prefill_chunk=2**15)}
        if not smoke:
            fns["cudnn_bf16"] = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                                          implementation="cudnn"))
        row = dict(b=b, hq=hq, hkv=hkv, s=s, d=d, causal=causal, ms={}, temp_mib={},
                   args_mib=sum(x.size * x.dtype.itemsize for x in (q, k, v)) / 2**20)
        for name, fn in fns.items():
            row["temp_mib"][name] = temp_mib(fn, q, k, v)
            row["ms"][name] = time_fn(fn, q, k, v, warmup=1, iters=2, batches=2)
        rows.append(row)
        log(f"  long prefill B{b} H{hq}/{hkv} S{s} causal={causal}: " + " ".join(
            f"{m} {t:.1f} ms (temp {row['temp_mib'][m]:.0f} MiB)" for m, t in row["ms"].items()))
    return rows


def prefill_sweep(log, smoke):
    """The prefill's launch parameters (``block`` is part of the numerics and stays 64) at f = 0.05."""
    b, hq, hkv, s, d, causal = SMOKE["prefill"][0] if smoke else PREFILL_SHAPES[0]
    q, k, v = inputs(jax.random.PRNGKey(3), b, hq, hkv, s, d, heavy=False)
    impl = dict(implementation="pallas", interpret=True) if smoke else {}
    rows = []
    for warps, stages in [(4, 2)] if smoke else [(4, 2), (4, 3), (8, 2), (8, 3), (4, 1)]:
        cfg = lb.ThriftConfig(num_warps=warps, num_stages=stages)
        fn = jax.jit(functools.partial(lb.thrift_attention, causal=causal, budget=0.05, config=cfg, **impl))
        try:
            ms = time_fn(fn, q, k, v, warmup=1, iters=3 if smoke else 10, batches=3)
        except Exception as e:  # noqa: BLE001
            log(f"  sweep w{warps} s{stages} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        rows.append(dict(b=b, hq=hq, hkv=hkv, s=s, d=d, causal=causal, num_warps=warps, num_stages=stages, ms=ms))
        log(f"  prefill sweep B{b} S{s} causal={causal} w{warps} s{stages}: {ms:.2f} ms")
    return rows


def decode_inputs(b, hq, hkv, s, d):
    """Heavy-hitter q, k, v (:func:`inputs`) and a :class:`lowbit_jax.ThriftKVCache` full of k, v: the decode
    section's and the decode sweep's inputs."""
    q, k, v = inputs(jax.random.PRNGKey(5), b, hq, hkv, s, d, heavy=True)
    cache = jax.jit(lambda c, k, v: c.append(k, v))(lb.ThriftKVCache.create(b, s, hkv, d), k, v)
    return q, k, v, cache


#: (new tokens, budget) cases of the decode launch sweep: one token at three budgets (16-row tiles with a
#: group of 4), 16 tokens (64-row tiles)
DECODE_SWEEP = [(1, 0.05), (1, 0.25), (1, 1.0), (16, 0.05)]


def decode_sweep(log, smoke):
    """The decode kernel's launch parameters (its split counts are numerics), kernel alone, per query rows per
    program and budget (f = 0.05: 95% of the blocks 4-bit; f = 1: all 16-bit)."""
    impl = dict(implementation="pallas", interpret=True) if smoke else {}
    launches = [(2, 2)] if smoke else [(2, 2), (4, 2), (2, 3), (4, 3), (1, 2)]
    rows = []
    for b, hq, hkv, s, d, _ in SMOKE["decode"] if smoke else DECODE_SHAPES[::2]:
        q, k, v, cache = decode_inputs(b, hq, hkv, s, d)
        for tokens, budget in DECODE_SWEEP[:1] if smoke else DECODE_SWEEP:
            row_tile = thrift_backends.decode_layout(tokens * hq // hkv)[1]
            for warps, stages in launches:
                cfg = lb.ThriftConfig(decode_warps=warps, decode_stages=stages)
                if smoke:
                    cfg = dataclasses.replace(cfg, decode_splits=2, decode_splits_high=2)
                try:
                    ms = decode_kernel_ms(q[:, -tokens:], cache, budget, cfg, impl, 3 if smoke else 20)
                except Exception as e:  # noqa: BLE001
                    log(f"  decode sweep T{tokens} f={budget} w{warps} s{stages} failed: {type(e).__name__}: "
                        f"{str(e)[:200]}")
                    continue
                rows.append(dict(kind="decode", budget=budget, tokens=tokens, row_tile=row_tile, b=b, hq=hq,
                                 hkv=hkv, s=s, d=d, warps=warps, stages=stages, kernel_ms=ms))
                log(f"  decode sweep B{b} S{s} T{tokens} (rows {row_tile}) f={budget} w{warps} s{stages}: "
                    f"kernel {ms:.3f} ms")
    return rows


#: (B, Hq, Hkv, S, D, new tokens) of the ``decode_wgs`` section, f = 0.05
DECODE_WGS_SHAPES = DECODE_SHAPES + [(8, 32, 8, 32768, 128, 4)]


def decode_wgs(log, smoke):
    """The Mosaic decode kernel's compute warpgroups a CTA (``ThriftConfig.decode_compute_wgs``), f = 0.05: the
    split-KV kernels and combine alone (:func:`decode_kernels`) and the whole op, each variant's output against the
    one-warpgroup kernel's (max |difference|; the same runs and numerics, so float rounding at most), cuDNN's bf16
    decode beside them, in interleaved rounds."""
    impl = dict(implementation="pallas", interpret=True) if smoke else {}
    rows = []
    for b, hq, hkv, s, d, t in SMOKE["decode"] if smoke else DECODE_WGS_SHAPES:
        q, k, v, cache = decode_inputs(b, hq, hkv, s, d)
        qt = q[:, -t:]
        row = dict(b=b, hq=hq, hkv=hkv, s=s, d=d, t=t, budget=0.05, max_abs_vs_1={}, errors={})
        timed, outs = {}, {}
        if not smoke:
            cudnn = jax.jit(lambda q, kc, vc, n: jax.nn.dot_product_attention(
                q, kc, vc, key_value_seq_lengths=jnp.full((q.shape[0],), n, jnp.int32), implementation="cudnn"))
            timed["cudnn_bf16"] = (cudnn, (qt, cache.k, cache.v, cache.length))
        for wgs in (1, 2, 4):
            cfg = lb.ThriftConfig(decode_backend="mosaic", decode_compute_wgs=wgs,
                                  **(dict(decode_splits=4, decode_splits_high=2) if smoke else {}))
            try:
                op = jax.jit(functools.partial(lb.thrift_decode, budget=0.05, config=cfg, **impl))
                outs[wgs] = np.asarray(op(qt, cache), np.float32)
                fn, args, _ = decode_kernels(qt, cache, 0.05, cfg, impl)
                jax.block_until_ready(fn(*args))
            except Exception as e:  # noqa: BLE001
                row["errors"][wgs] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"  decode_compute_wgs={wgs} failed: {row['errors'][wgs]}")
                continue
            timed[f"op wgs{wgs}"] = (op, (qt, cache))
            timed[f"kernels wgs{wgs}"] = (fn, args)
            row["max_abs_vs_1"][wgs] = float(np.max(np.abs(outs[wgs] - outs[1]))) if 1 in outs else None
        calls = 1 if smoke else DECODE_CALLS
        ops = {n: e for n, e in timed.items() if not n.startswith("kernels")}
        row["ms"], row["ms_rounds"] = time_rounds(ops, 1 if smoke else DECODE_ROUNDS, calls=calls, warmup=1,
                                                  iters=3 if smoke else 5, batches=3)
        kernels = {n: e for n, e in timed.items() if n.startswith("kernels")}  # already chained: calls a dispatch
        kms, _ = time_rounds(kernels, 1 if smoke else DECODE_ROUNDS, warmup=1, iters=1 if smoke else 5, batches=3)
        row["ms"].update({n: ms / calls for n, ms in kms.items()})
        base = row["ms"].get("cudnn_bf16")
        row["vs_cudnn_bf16"] = {n: base / ms for n, ms in row["ms"].items()} if base else {}
        rows.append(row)
        log(f"  decode_wgs B{b} H{hq}/{hkv} S{s} D{d} T{t}: " + ", ".join(
            f"{n} {ms:.4f} ms" for n, ms in row["ms"].items()) + f"; max |out − wgs1| {row['max_abs_vs_1']}")
    return rows


def prefill_parts(q, k, v, causal, budget, impl, iters):
    """Time of the selection kernel, the operand pass and the prefill kernel alone (ms)."""
    opts = thrift_mod.resolve_thrift_options(q, k, v, causal=causal, budget=budget, **impl)
    sel = jax.jit(lambda q, k: thrift_mod._selection(q, k, opts))
    ops = jax.jit(lambda k, v: thrift_mod.operands(k, v, opts))
    operands = ops(k, v)
    order = thrift_backends.prefill_order(sel(q, k), opts)
    from pallas_kernels.thrift_prefill import thrift_prefill
    kern = functools.partial(thrift_prefill, sq_len=opts.seq_q, sk_len=opts.seq_k, causal=causal, scale=opts.scale,
                             k=opts.topk, config=opts.config, interpret=opts.interpret)
    return {"select": time_fn(sel, q, k, warmup=1, iters=iters, batches=3),
            "operands": time_fn(ops, k, v, warmup=1, iters=iters, batches=3),
            "prefill_kernel": time_fn(kern, q, *operands, order, warmup=1, iters=iters, batches=3)}


def decode_bytes(cache: lb.ThriftKVCache, selected: np.ndarray, q: jax.Array | None = None,
                 splits: int = 0) -> dict[str, float]:
    """Bytes one decode step moves. "kv": K and V, 16-bit for the selected blocks, 4-bit (codes + scales)
    else; "thrift": those plus the block means the selection reads, the query, and the split-KV partial
    outputs (acc, m, l in float32 of each of ``splits`` runs, written by the kernel and read by the combine);
    "bf16": the whole 16-bit K and V."""
    b, hkv, nkb = selected.shape
    d, blk = cache.head_dim, cache.block
    per16 = 2 * blk * d * cache.k.dtype.itemsize
    per4 = 2 * (blk * d // 2 + blk * d // 16)
    n16 = int(selected.sum())
    kv = n16 * per16 + (b * hkv * nkb - n16) * per4
    extra = cache.k_mean.size * cache.k_mean.dtype.itemsize
    if q is not None:
        rows = q.shape[1] * q.shape[2]  # tokens × query heads
        extra += q.size * q.dtype.itemsize + 2 * b * splits * rows * (d + 2) * 4
    return {"kv": kv, "thrift": kv + extra, "bf16": b * hkv * nkb * per16}


#: timing rounds of the decode section: each round times every variant once, a variant's figure is its median
DECODE_ROUNDS = 3


def decode(log, smoke):
    rows = []
    impl = dict(implementation="pallas", interpret=True) if smoke else {}
    extra = [DECODE_VARIANTS[0], DECODE_VARIANTS[1], (1.0, None, None, "auto")]
    shapes = [(x, DECODE_VARIANTS) for x in DECODE_SHAPES] + [(x, extra) for x in DECODE_EXTRA_SHAPES]
    for (b, hq, hkv, s, d, t), variants in [(x, DECODE_VARIANTS[:1]) for x in SMOKE["decode"]] if smoke else shapes:
        q, k, v, cache = decode_inputs(b, hq, hkv, s, d)
        qt = q[:, -t:]
        iters = 3 if smoke else 20
        row = dict(b=b, hq=hq, hkv=hkv, s=s, d=d, t=t, ms={}, kernel_ms={}, bytes={}, errors={},
                   cache_bytes=cache.nbytes(), rounds=1 if smoke else DECODE_ROUNDS)
        exact = exact_attention(qt, k, v, True)
        row["error_vs_exact"] = {}
        timed = {}  # name -> (fn, args): timed in interleaved rounds once every variant has compiled
        bf16_bytes = 2 * cache.k.size * cache.k.dtype.itemsize  # the whole 16-bit K and V
        if not smoke and (b, hq, hkv, s, d, t) in DECODE_SHAPES:
            xla = jax.jit(lambda q, kc, vc: jax.nn.dot_product_attention(q, kc, vc, is_causal=False))
            timed["xla_bf16"] = (xla, (qt, cache.k, cache.v))
            row["bytes"]["xla_bf16"] = bf16_bytes
            row["error_vs_exact"]["xla_bf16"] = lb.error_metrics(xla(qt, cache.k, cache.v), exact)
        if not smoke:
            # cuDNN's flash attention over the filled length (the models' 16-bit decode, models.cached_attention;
            # for T > 1 without the mask among the new tokens: a timing baseline)
            cudnn = jax.jit(lambda q, kc, vc, n: jax.nn.dot_product_attention(
                q, kc, vc, key_value_seq_lengths=jnp.full((q.shape[0],), n, jnp.int32), implementation="cudnn"))
            timed["cudnn_bf16"] = (cudnn, (qt, cache.k, cache.v, cache.length))
            row["bytes"]["cudnn_bf16"] = bf16_bytes
            row["error_vs_exact"]["cudnn_bf16"] = lb.error_metrics(cudnn(qt, cache.k, cache.v, cache.length), exact)
        for f, splits, high, backend in variants:
            name = f"thrift_f{f:g}_s{splits or 'auto'}_h{high or 'auto'}" + ("" if backend == "auto" else f"_{backend}")
            cfg = dataclasses.replace(lb.ThriftConfig(), decode_splits=splits if not smoke else 2,
                                      decode_splits_high=high if not smoke else 2, decode_backend=backend)
            try:
                fn = jax.jit(functools.partial(lb.thrift_decode, budget=f, config=cfg, **impl))
                o = fn(qt, cache)
                timed[name] = (fn, (qt, cache))
                sel = np.asarray(decode_selection(qt, cache.k_mean, cache.length, budget=f, block=cfg.block))
                resolved = thrift_mod.decode_config(qt, cache, budget=f, config=cfg, interpret=smoke)
                moved = decode_bytes(cache, sel, qt, sum(resolved.split_counts()))
                row["bytes"][name], row.setdefault("kv_bytes", {})[name] = moved["thrift"], moved["kv"]
                row["error_vs_exact"][name] = lb.error_metrics(o, exact)
                if (f, splits, high) == DECODE_VARIANTS[0][:3]:
                    row["kernel_ms"][name] = decode_kernel_ms(qt, cache, f, cfg, impl, iters)
            except Exception as e:  # noqa: BLE001
                row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"  {name} failed: {row['errors'][name]}")
        row["calls_per_dispatch"] = 1 if smoke else DECODE_CALLS
        row["ms"], row["ms_rounds"] = time_rounds(timed, row["rounds"], calls=row["calls_per_dispatch"],
                                                  warmup=1, iters=3 if smoke else 5, batches=3)
        row["gbps"] = {m: row["bytes"][m] / t / 1e6 for m, t in row["ms"].items() if m in row["bytes"]}
        base = row["ms"].get("xla_bf16")
        row["vs_xla_bf16"] = {m: base / t for m, t in row["ms"].items()} if base else {}
        base = row["ms"].get("cudnn_bf16")
        row["vs_cudnn_bf16"] = {m: base / t for m, t in row["ms"].items()} if base else {}
        rows.append(row)
        log(f"  decode B{b} H{hq}/{hkv} S{s} D{d}: " + " ".join(
            f"{m} {t:.3f} ms ({row['gbps'].get(m, 0):.0f} GB/s, rel-L2 {row['error_vs_exact'][m]['rel_l2']:.4f})"
            for m, t in row["ms"].items()) + " | kernel " + " ".join(
            f"{m} {t:.3f}" for m, t in row["kernel_ms"].items()))
    return rows


def decode_kernels(q, cache, budget, cfg, impl) -> tuple:
    """``(fn, args, calls)``: the split-KV kernels and their combine alone (selection and row layout done outside),
    ``calls`` a dispatch (:data:`DECODE_CALLS` by :func:`benchmarks.common.chained`; one when interpreted): the
    Triton kernel, or with the Mosaic backend (``cfg.decode_backend``) the Mosaic kernel of the 4-bit runs and the
    Triton kernel of the 16-bit ones (:func:`lowbit_jax.thrift_backends.decode_partials`), then
    :func:`pallas_kernels.thrift_combine.combine_decode`."""
    t, hq, d = q.shape[1], q.shape[2], q.shape[3]
    interpret = impl.get("interpret", False)
    rows = t * (hq // cache.num_kv_heads)
    cfg = thrift_mod.decode_config(q, cache, budget=budget, config=cfg, interpret=interpret)
    r_pad, row_tile = thrift_backends.decode_layout(rows)
    scalars = thrift_backends.decode_scalars(q, cache, budget=budget, block=cfg.block, r_pad=r_pad)
    q_rows, qf, *rest = thrift_backends.decode_kernel_args(q, cache, scalars, interpret=interpret)

    def kernels(qf, q_rows, *rest):  # qf first: chained() perturbs it, and every 4-bit run reads it
        groups = thrift_backends.decode_partials((q_rows, qf, *rest), scale=d**-0.5, config=cfg,
                                                 row_tile=row_tile, rows=rows, interpret=interpret)
        return thrift_combine.combine_decode(groups, rest[0], rows=rows, tokens=t, num_heads=hq, out_dtype=q.dtype,
                                             interpret=interpret)

    calls = 1 if interpret else DECODE_CALLS
    return chained(kernels, calls), (qf, q_rows, *rest), calls


def decode_kernel_ms(q, cache, budget, cfg, impl, iters):
    """ms per decode step of :func:`decode_kernels`."""
    fn, args, calls = decode_kernels(q, cache, budget, cfg, impl)
    return time_fn(fn, *args, warmup=1, iters=max(1, iters // 4), batches=3) / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode; runs anywhere")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.smoke:
        print("benchmarks/thrift.py needs a GPU (or --smoke)")
        return 2
    name = "thrift_smoke" if args.smoke else "thrift"
    payload = dict(env=environment(), command="PYTHONPATH=. python benchmarks/thrift.py " + " ".join(
        argv if argv is not None else sys.argv[1:]))
    payload = keep_other_sections(payload, RESULTS_DIR / f"{name}.json", args.sections, SECTIONS)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    log(f"# {payload['env']}")
    runners = dict(checks=check_kernels, accuracy=accuracy, prefill=prefill, long=long_prefill, decode=decode,
                   sweep=prefill_sweep, decode_sweep=decode_sweep, decode_wgs=decode_wgs)
    for section in args.sections:
        log(f"## {section}")
        payload[section] = runners[section](log, args.smoke)
        write_json(name, payload)
    for p in write_json(name, payload):
        log(f"wrote {p}")
    return 0


if __name__ == "__main__":
    # The xla twins round their 16-bit intermediates (P before P·V) as the kernels do only if XLA may not keep
    # them in float32 (on the GPU it may by default: the twin then measured 1.4e-3 rel-L1 from the kernels with
    # GQA, closer to exact attention than any 16-bit kernel). Set before the backend starts, and only for a run
    # of this script: an import (the tests) must not change the flags of the importing process's children.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()
    sys.exit(main())
