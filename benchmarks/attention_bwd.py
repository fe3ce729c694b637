"""Attention fwd+bwd benchmark on the GPU: SageBwd (INT8) vs cuDNN bf16, JAX's Pallas mha, XLA.

Usage (GPU machine, repo root):
    PYTHONPATH=. python benchmarks/attention_bwd.py
    PYTHONPATH=. python benchmarks/attention_bwd.py --smoke     # tiny shapes, any backend (checks the script)
    PYTHONPATH=. python benchmarks/attention_bwd.py --backends  # only the per-kernel backend table

Measures one jitted fwd+bwd (``jax.vjp`` then the pullback of a random dO) per
method: time, TFLOP/s (3.5× the forward's 4·B·H·Sq·Sk·D, halved if causal),
peak GPU memory of one fwd+bwd in a fresh process (``memory_stats()``; with the
compiled step's own split into arguments, outputs and XLA temp buffers,
``compiled.memory_analysis()``; ``--memory-only`` re-runs just that), the
compiled-kernel gradients against the xla reference on awkward shapes, and the
per-intermediate error report against exact fp32 on N(0,1) and K-outlier inputs.
Writes benchmarks/results/attention_bwd.json (and $OUT/attention_bwd.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp

import lowbit_jax as lb
from benchmarks.attention import make_inputs
from benchmarks.common import (
    ROUND_WARMUP, ROUNDS, attention_flops, carried_part, compiled_entries, environment, fwd_bwd, rerun_part,
    time_fn, time_rounds, write_json,
)

warnings.filterwarnings("ignore", category=DeprecationWarning)

SHAPES = [(4, 32, 4096, 128, False), (1, 32, 16384, 128, False), (4, 32, 4096, 128, True),
          (1, 32, 16384, 128, True), (8, 32, 2048, 64, False)]
SMOKE_SHAPES = [(1, 2, 128, 64, False), (1, 2, 96, 64, True)]
MEMORY_SHAPES = [(4, 32, 4096, 128, False)]
XLA_SCORE_BYTES_LIMIT = 20e9


SAGE_OVERRIDES: dict = {}  # --dq-tiles: SageFwdConfig fields replaced in the sage runs


#: sage variants (SageFwdConfig fields replaced): every backward kernel (and, for "all", the forward) on
#: one Pallas backend, or the default backends with per-row dS scales
SAGE_BACKENDS = {
    "sage_triton": dict(dkdv_backend="triton", dq_backend="triton", fwd_backend="triton"),
    "sage_mosaic": dict(dkdv_backend="mosaic", dq_backend="mosaic", fwd_backend="triton"),
    "sage_mosaic_all": dict(dkdv_backend="mosaic", dq_backend="mosaic", fwd_backend="mosaic"),
    "sage_ds_row": dict(ds_scale="row"),  # the library's backends, dS scaled per row (SageFwdConfig.ds_scale)
}


def sage_config(d: int, causal: bool) -> lb.SageFwdConfig:
    """The library's default config for (d, causal), with ``SAGE_OVERRIDES`` applied."""
    return dataclasses.replace(lb.sage_fwd_config(d, causal), **SAGE_OVERRIDES)


def attention_fn(method: str, d: int, causal: bool):
    """name → f(q, k, v) → o."""
    if method == "sage":
        return functools.partial(lb.sage_attention, causal=causal, config=sage_config(d, causal))
    if method in SAGE_BACKENDS:
        cfg = dataclasses.replace(sage_config(d, causal), **SAGE_BACKENDS[method])
        return functools.partial(lb.sage_attention, causal=causal, config=cfg)
    if method == "cudnn_bf16":
        return functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn")
    if method == "xla_bf16":
        return functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="xla")
    if method == "pallas_mgpu_bf16":  # JAX's Hopper flash attention in Pallas Mosaic GPU (the other backend)
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        # compute_wgs_bwd=2: its faster setting at B4 H32 S4096 D128
        cfg = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal,
                                          block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64,
                                          compute_wgs_bwd=2)
        f16 = jnp.float16  # its kernels hard-code fp16 SMEM in jax 0.11.2 (bf16 inputs are refused)

        def mgpu(q, k, v):
            return attention_mgpu.attention(q.astype(f16), k.astype(f16), v.astype(f16), config=cfg).astype(q.dtype)

        return mgpu
    if method == "pallas_mha_bf16":
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        return functools.partial(pallas_attention.mha, segment_ids=None, sm_scale=d**-0.5, causal=causal)
    raise ValueError(method)


def methods_for(b, h, s, d, causal):
    names = ["sage", "cudnn_bf16", "pallas_mha_bf16", "sage_mosaic", "sage_mosaic_all", "sage_ds_row"]
    if not causal:  # attention_mgpu has no causal backward in jax 0.11.2; causal all-Triton: the --backends table
        names += ["sage_triton", "pallas_mgpu_bf16"]
    if b * h * s * s * 4 * 4 <= XLA_SCORE_BYTES_LIMIT:
        names.append("xla_bf16")
    return names


#: per-kernel backend splits timed by --backends ("auto" is the library's choice of backward backends)
BACKEND_SPLITS = {
    "triton": SAGE_BACKENDS["sage_triton"],
    "mosaic": SAGE_BACKENDS["sage_mosaic"],
    "dkdv_triton_dq_mosaic": dict(dkdv_backend="triton", dq_backend="mosaic", fwd_backend="triton"),
    "dkdv_mosaic_dq_triton": dict(dkdv_backend="mosaic", dq_backend="triton", fwd_backend="triton"),
    "auto": dict(fwd_backend="triton"),  # the backward backends "auto" picks; the forward is Triton in every column
}
#: (B, Sq=Sk, Hq, Hkv, D, causal): SHAPES plus the 50m training model's attention (GQA 10/5)
BACKEND_SHAPES = [(b, s, h, h, d, c) for b, h, s, d, c in SHAPES] + [(16, 2048, 10, 5, 64, True)]
SMOKE_BACKEND_SHAPES = [(1, 128, 2, 1, 64, True)]


def backend_splits(shapes, log, save, smoke=False):
    """fwd+bwd ms of sage with each (dK/dV, dQ) backend pair, beside cuDNN: the table behind
    ``sage._mosaic_backend``'s "auto" rule."""
    rows = []
    for b, s, hq, hkv, d, causal in shapes:
        keys = jax.random.split(jax.random.PRNGKey(3), 4)
        q, do = (jax.random.normal(kk, (b, s, hq, d), jnp.bfloat16) for kk in (keys[0], keys[3]))
        k, v = (jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16) for kk in keys[1:3])
        iters = 3 if s >= 16384 else 10
        row = dict(b=b, s=s, hq=hq, hkv=hkv, d=d, causal=causal, ms={}, errors={})
        fns = {} if smoke else {"cudnn_bf16": attention_fn("cudnn_bf16", d, causal)}
        for name, kw in BACKEND_SPLITS.items():
            cfg = dataclasses.replace(sage_config(d, causal), **kw)
            fns[name] = functools.partial(lb.sage_attention, causal=causal, config=cfg, interpret=smoke)
        for name, fn in fns.items():
            try:
                row["ms"][name] = time_fn(fwd_bwd(fn), q, k, v, do, warmup=1 if smoke else 2,
                                          iters=1 if smoke else iters, batches=1 if smoke else 3)
            except Exception as e:  # noqa: BLE001
                row["errors"][name] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        log(f"B{b} S{s} H{hq}/{hkv} D{d} causal={causal!s:5} " + " ".join(f"{m}={t:.2f}" for m, t in row["ms"].items())
            + " ms" + (f" errors={row['errors']}" if row["errors"] else ""))
        save(rows)
    return rows


def throughput(shapes, log, save, smoke=False):
    rows = []
    for b, h, s, d, causal in shapes:
        q, k, v = make_inputs(jax.random.PRNGKey(3), b, h, s, d)
        do = jax.random.normal(jax.random.PRNGKey(4), q.shape, q.dtype)
        flops = 3.5 * attention_flops(b, h, s, s, d, causal)
        row = dict(b=b, h=h, s=s, d=d, causal=causal, ms={}, tflops={}, errors={})
        long = s * s * b >= 4 * 8192 * 8192
        # timed in interleaved rounds once every method has compiled (common.time_rounds)
        timed = compiled_entries({name: {name: (fwd_bwd(attention_fn(name, d, causal)), (q, k, v, do))}
                                  for name in (["sage"] if smoke else methods_for(b, h, s, d, causal))},
                                 row["errors"], log, f" at B{b} S{s} D{d} causal={causal}")
        row["rounds"], row["warmup"] = (1 if smoke else ROUNDS), ROUND_WARMUP
        row["ms"], row["ms_rounds"] = time_rounds(timed, row["rounds"], warmup=ROUND_WARMUP, iters=3 if long else 10,
                                                    batches=1)
        row["tflops"] = {name: flops / ms / 1e9 for name, ms in row["ms"].items()}
        base = row["ms"].get("cudnn_bf16")
        row["vs_cudnn_bf16"] = {m: base / t for m, t in row["ms"].items()} if base else {}
        rows.append(row)
        log(f"B{b} H{h} S{s} D{d} causal={causal!s:5} " + " ".join(f"{m}={v:.0f}" for m, v in row["tflops"].items())
            + f" TFLOP/s | sage/cudnn={row['vs_cudnn_bf16'].get('sage', float('nan')):.2f}")
        save(rows)
    return rows


BWD_SWEEP = [  # (fwd block_q, fwd block_k, bwd block_q, bwd block_k, bwd warps, bwd stages)
    (64, 128, 64, 64, 4, 2), (64, 128, 64, 64, 4, 3), (64, 128, 64, 64, 8, 2), (64, 128, 64, 128, 4, 2),
    (64, 128, 64, 128, 8, 2), (64, 128, 32, 64, 4, 2), (64, 128, 32, 128, 4, 2), (64, 128, 64, 32, 4, 2),
    (128, 128, 128, 64, 8, 2), (128, 128, 128, 64, 4, 2), (128, 128, 64, 128, 8, 2),
]


def sweep_configs() -> list[lb.SageFwdConfig]:
    return [lb.SageFwdConfig(block_q=fq, block_k=fk, num_warps=8 if fq == 128 else 4, num_stages=2 if fq == 128 else 3,
                             bwd_block_q=bq, bwd_block_k=bk, bwd_warps=w, bwd_stages=st)
            for fq, fk, bq, bk, w, st in BWD_SWEEP]


DQ_SWEEP = [(64, 4, 2), (128, 4, 2), (128, 4, 3), (128, 8, 2), (64, 4, 3), (32, 4, 2)]  # (dq_block_k, warps, stages)


def dq_sweep_configs() -> list[lb.SageFwdConfig]:
    """The dQ kernel's tiles on the default D128 config (dK/dV tiles unchanged)."""
    base = lb.sage_fwd_config(128, False)
    return [dataclasses.replace(base, dq_block_k=bk, dq_warps=w, dq_stages=st) for bk, w, st in DQ_SWEEP]


def sweep_backward(log, shapes=((4, 32, 4096, 128, False), (4, 32, 4096, 128, True)), smoke=False, save=None,
                   configs=None):
    """Backward tiles: time of the SageBwd kernels alone (from the forward's residuals) per config.

    ``save(rows)`` is called after every row, so a run cut short keeps what it measured.
    """
    from lowbit_jax.sage import _backward, _forward, resolve_options
    from lowbit_jax.sage_reference import sage_backward_reference

    configs = configs or sweep_configs()
    rows = []
    for b, h, s, d, causal in shapes:
        q, k, v = make_inputs(jax.random.PRNGKey(3), b, h, s, d)
        do = jax.random.normal(jax.random.PRNGKey(4), q.shape, q.dtype)
        flops = 2.5 * attention_flops(b, h, s, s, d, causal)
        for cfg in configs[:2] if smoke else configs:
            fq, fk, bq, bk, w, st = (cfg.block_q, cfg.block_k, cfg.bwd_block_q, cfg.bwd_block_k, cfg.bwd_warps,
                                     cfg.bwd_stages)
            extra = dict(implementation="pallas", interpret=True) if smoke else {}
            opts = resolve_options(q, k, v, causal=causal, config=cfg, **extra)
            row = dict(b=b, h=h, s=s, d=d, causal=causal, config=dict(fwd=(fq, fk), bwd=(bq, bk), warps=w, stages=st,
                                                                         dq=(cfg.dq_block_k, cfg.dq_warps,
                                                                             cfg.dq_stages)))
            try:
                o, lse, ops = _forward(q, k, v, opts=opts, transposed=True)
                bwd = jax.jit(lambda ops, o, lse, do: _backward(ops, o, lse, do, opts=opts))  # noqa: B023
                row["bwd_ms"] = time_fn(bwd, ops, o, lse, do, warmup=1, iters=3 if smoke else 10, batches=3)
                row["bwd_tflops"] = flops / row["bwd_ms"] / 1e9
                ref = sage_backward_reference(ops, None, o, lse, do, sq_len=s, sk_len=s, causal=causal,
                                              per_block=True, scale=opts.scale, config=opts.config)
                got = bwd(ops, o, lse, do)
                row["vs_xla_rel_l1"] = {n: lb.error_metrics(g, r)["rel_l1"] for n, g, r in zip(("dq", "dk", "dv"),
                                                                                              got, ref)}
                log(f"  bwd sweep B{b} S{s} D{d} causal={causal!s:5} fwd {fq}x{fk} bwd {bq}x{bk} w{w} s{st}: "
                    f"dq {row['config']['dq']}: {row['bwd_ms']:.2f} ms ({row['bwd_tflops']:.0f} TOP/s, 2.5x fwd FLOPs) rel-L1 vs xla "
                    + " ".join(f"{n}={v:.1e}" for n, v in row["vs_xla_rel_l1"].items()))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"  bwd sweep {row['config']} failed: {row['error']}")
            rows.append(row)
            if save is not None:
                save(rows)
    return rows


def check_gradients(log, smoke=False):
    """Compiled kernels' gradients vs the xla reference (same quantization) and exact autodiff."""
    rows = []
    # (..., backend): "default" = the config's backend choice; "mosaic" = every kernel on Mosaic GPU;
    # "+ds_row": dS scaled per row (SageFwdConfig.ds_scale="row")
    cases = [(2, 100, 77, 4, 2, 64, True, "per_block", False, "default"),
             (1, 300, 300, 4, 1, 128, False, "per_token", True, "default"),
             (2, 129, 257, 8, 2, 128, True, "per_block", True, "default"),
             (1, 512, 512, 4, 2, 128, False, "per_token", False, "mosaic"),
             (2, 384, 640, 4, 4, 64, True, "per_block", False, "mosaic"),
             (2, 129, 257, 8, 2, 128, True, "per_token", False, "default+ds_row"),
             (1, 512, 512, 4, 2, 128, False, "per_block", False, "mosaic+ds_row"),
             # Sq not a multiple of 8 (the TMA tiling's rows) on the Mosaic kernels
             (2, 380, 512, 4, 2, 64, False, "per_block", False, "default"),
             (1, 380, 512, 4, 2, 128, True, "per_token", False, "mosaic+ds_row"),
             # Sq_pad 1024 over the D64 forward's 192-row CTAs: the last CTA passes it (_mosaic.query_ctas)
             (2, 1000, 1000, 4, 2, 64, True, "per_block", False, "default")]
    impl = dict(implementation="pallas", interpret=True) if smoke else dict(implementation="pallas")
    for b, sq, sk, hq, hkv, d, causal, gran, smooth_q, backend in cases[:1] if smoke else cases:
        kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(sq * sk), 4)
        q = jax.random.normal(kq, (b, sq, hq, d), jnp.bfloat16)
        k = (jax.random.normal(kk, (b, sk, hkv, d)) + 2.0).astype(jnp.bfloat16)
        v = jax.random.normal(kv, (b, sk, hkv, d), jnp.bfloat16)
        do = jax.random.normal(kd, q.shape, q.dtype)
        cfg = sage_config(d, causal)
        if backend.startswith("mosaic"):
            cfg = dataclasses.replace(cfg, **SAGE_BACKENDS["sage_mosaic_all"])
        if backend.endswith("+ds_row"):
            cfg = dataclasses.replace(cfg, **SAGE_BACKENDS["sage_ds_row"])
        kw = dict(causal=causal, qk_granularity=gran, smooth_q=smooth_q, config=cfg)
        row = dict(case=(b, sq, sk, hq, hkv, d, causal), gran=gran, smooth_q=smooth_q, backend=backend)
        try:
            g_p = fwd_bwd(functools.partial(lb.sage_attention, **kw, **impl))(q, k, v, do)
        except Exception as e:  # noqa: BLE001  (recorded; the rest of the run goes on)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            log(f"  grad check FAILED {row['case']} {backend}: {row['error']}")
            continue
        g_x = fwd_bwd(functools.partial(lb.sage_attention, **kw, implementation="xla"))(q, k, v, do)
        f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]  # noqa: E731
        g_e = fwd_bwd(functools.partial(lb.reference_attention, causal=causal))(*f32(q, k, v, do))
        for i, name in enumerate(("o", "dq", "dk", "dv")):
            row[name] = dict(kernel_vs_xla=lb.error_metrics(g_p[i], g_x[i]), kernel_vs_exact=lb.error_metrics(
                g_p[i], g_e[i]), finite=bool(jnp.all(jnp.isfinite(g_p[i].astype(jnp.float32)))))
        rows.append(row)
        log(f"  grad check {row['case']} {backend} " + " ".join(
            f"{n}: vs-xla rel-L1 {row[n]['kernel_vs_xla']['rel_l1']:.1e} vs-exact cos {row[n]['kernel_vs_exact']['cos_sim']:.5f}"
            for n in ("dq", "dk", "dv")))
    return rows


def error_reports(log, smoke=False):
    rows = []
    b, h, s, d = (1, 2, 128, 64) if smoke else (1, 8, 4096, 128)
    for label, outlier in (("normal", 0.0), ("k_outlier_10x", 10.0)):
        q, k, v = make_inputs(jax.random.PRNGKey(11), b, h, s, d, k_outlier=outlier)
        do = jax.random.normal(jax.random.PRNGKey(12), q.shape, q.dtype)
        variants = [("sage int8 bwd", {}), ("sage int8 bwd, dS per row", dict(ds_scale="row"))]
        if label == "normal":
            variants.append(("sage bf16 bwd (ablation)", dict(backward="bf16")))
        else:
            variants.append(("sage no smoothing", dict(smooth_k=False)))
        for variant, opts in variants:
            if smoke:
                opts = dict(opts, implementation="xla")
            config = dataclasses.replace(sage_config(d, False), ds_scale=opts.pop("ds_scale", "tile"))
            rep = lb.diagnostics.attention_error_report(q, k, v, do, causal=False, print_table=False,
                                                        config=config, **opts)
            rows.append(dict(b=b, h=h, s=s, d=d, inputs=label, variant=variant, report=rep))
            log(f"  report {label:13s} {variant:26s} " + " ".join(
                f"{n}={m['cos_sim']:.4f}/{m['rel_l2']:.3f}" for n, m in rep.items()))
    return rows


MEMORY_SETTINGS = {
    "inputs": "q, k, v are the step's inputs (they stay alive for the whole fwd+bwd)",
    "layer": "q, k, v are computed in the step (x·w_q, x·w_k, x·w_v, per-channel w): as in a model, "
             "they are freed after the forward unless the attention keeps them as residuals",
}


def peak_memory(method: str, setting: str, b: int, h: int, s: int, d: int, causal: bool) -> dict[str, int]:
    """Peak GPU bytes of one fwd+bwd in this (fresh) process (``peak``), and the compiled step's own split
    (``compiled.memory_analysis()``): its arguments, outputs and XLA temp buffers (``args``, ``out``,
    ``temp``: at the peak all three are live); ``setting`` from MEMORY_SETTINGS."""
    q, k, v = make_inputs(jax.random.PRNGKey(3), b, h, s, d)
    do = jax.random.normal(jax.random.PRNGKey(4), q.shape, q.dtype)
    attn = attention_fn(method, d, causal)
    if setting == "inputs":
        step, args = fwd_bwd(attn), (q, k, v, do)
    else:
        x = q
        del q, k, v
        w = jax.random.normal(jax.random.PRNGKey(5), (3, h, d), x.dtype)

        @jax.jit
        def step(x, w, do):
            o, vjp = jax.vjp(lambda x, w: attn(x * w[0], x * w[1], x * w[2]), x, w)
            return o, *vjp(do)

        args = (x, w, do)
    compiled = step.lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    split = compiled.memory_analysis()
    return dict(peak=int(jax.devices()[0].memory_stats()["peak_bytes_in_use"]),
                args=int(split.argument_size_in_bytes), out=int(split.output_size_in_bytes),
                temp=int(split.temp_size_in_bytes))


def memory_table(log):
    rows = []
    for b, h, s, d, causal in MEMORY_SHAPES:
        for setting, what in MEMORY_SETTINGS.items():
            row = dict(b=b, h=h, s=s, d=d, causal=causal, setting=setting, what=what, peak_bytes={}, temp_bytes={})
            for method in ("sage", "cudnn_bf16"):
                cmd = [sys.executable, __file__, "--memory", method, setting, str(b), str(h), str(s), str(d),
                       str(int(causal))]
                # the child allocates on demand: this process may still hold its preallocated share of the GPU
                env = {**os.environ, "PYTHONPATH": ".", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
                res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
                try:
                    got = json.loads(res.stdout.strip().splitlines()[-1])
                    row["peak_bytes"][method], row["temp_bytes"][method] = got["peak"], got["temp"]
                except (ValueError, IndexError, KeyError):
                    log(f"  memory {method} {setting} failed: {res.stderr[-500:]}")
            rows.append(row)
            log(f"  peak memory ({setting}) B{b} S{s} D{d}: " + " ".join(
                f"{m}={v / 2**30:.2f} GiB (temp {row['temp_bytes'][m] / 2**30:.2f})"
                for m, v in row["peak_bytes"].items()))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs anywhere")
    parser.add_argument("--memory", nargs=7, metavar=("METHOD", "SETTING", "B", "H", "S", "D", "CAUSAL"),
                        help="internal: print the peak memory of one fwd+bwd")
    parser.add_argument("--sweep", action="store_true", help="only sweep the backward tiles")
    parser.add_argument("--memory-only", action="store_true",
                        help="only the peak-memory table, written into the existing attention_bwd.json")
    parser.add_argument("--checks-only", action="store_true",
                        help="only the compiled-gradient checks, written into the existing attention_bwd.json")
    parser.add_argument("--skip-checks", action="store_true",
                        help="keep the existing attention_bwd.json's gradient checks (and their command and date) "
                             "instead of re-running them: for a table of kernels whose values did not change")
    parser.add_argument("--sweep-dq", action="store_true", help="only sweep the dQ kernel's tiles")
    parser.add_argument("--backends", action="store_true",
                        help="only time each (dK/dV, dQ) kernel backend pair (the 'auto' rule's table)")
    parser.add_argument("--dq-tiles", metavar="BK,WARPS,STAGES",
                        help="sage runs use these dQ-kernel tiles instead of the library default")
    args = parser.parse_args(argv)
    if args.memory:
        m, setting, b, h, s, d, c = args.memory
        print(json.dumps(peak_memory(m, setting, int(b), int(h), int(s), int(d), bool(int(c)))))
        return 0
    if jax.default_backend() != "gpu" and not args.smoke:
        print("benchmarks/attention_bwd.py needs a GPU (or --smoke)")
        return 2

    def log(msg):
        print(msg, flush=True)

    if args.dq_tiles:
        bk, w, st = (int(x) for x in args.dq_tiles.split(","))
        SAGE_OVERRIDES.update(dq_block_k=bk, dq_warps=w, dq_stages=st)
    if args.sweep or args.sweep_dq:
        name = "attention_bwd_" + ("dq_sweep" if args.sweep_dq else "sweep") + ("_smoke" if args.smoke else "")
        command = "PYTHONPATH=. python benchmarks/attention_bwd.py " + ("--sweep-dq" if args.sweep_dq else "--sweep")

        def save_sweep(rows):
            return write_json(name, dict(env=environment(), command=command, rows=rows))

        rows = sweep_backward(log, smoke=args.smoke, save=save_sweep,
                              shapes=((1, 2, 256, 64, True),) if args.smoke else sweep_backward.__defaults__[0],
                              configs=dq_sweep_configs() if args.sweep_dq else None)
        for p in save_sweep(rows):
            log(f"wrote {p}")
        return 0
    if args.backends:
        name = "attention_bwd_backends" + ("_smoke" if args.smoke else "")
        payload = dict(env=environment(), command="PYTHONPATH=. python benchmarks/attention_bwd.py --backends")

        def save_splits(rows):
            payload["rows"] = rows
            return write_json(name, payload)

        backend_splits(SMOKE_BACKEND_SHAPES if args.smoke else BACKEND_SHAPES, log, save_splits, smoke=args.smoke)
        for p in save_splits(payload["rows"]):
            log(f"wrote {p}")
        return 0
    name = "attention_bwd_smoke" if args.smoke else "attention_bwd"
    if args.checks_only or args.memory_only:  # re-run one part into the existing results file
        part, flag = ("gradient_checks", "--checks-only") if args.checks_only else ("memory", "--memory-only")
        value = check_gradients(log, smoke=args.smoke) if args.checks_only else memory_table(log)
        payload = rerun_part(name, part, value, command=f"PYTHONPATH=. python benchmarks/attention_bwd.py {flag}",
                             env=environment())
        for p in write_json(name, payload):
            log(f"wrote {p}")
        return 0
    payload = dict(env=environment(), command="PYTHONPATH=. python benchmarks/attention_bwd.py " + " ".join(
        argv if argv is not None else sys.argv[1:]))
    log(f"# {payload['env']}")
    if args.skip_checks:
        payload.update(carried_part(name, "gradient_checks"))
    else:
        payload["gradient_checks"] = check_gradients(log, smoke=args.smoke)
    write_json(name, payload)

    def save(rows):
        payload["throughput"] = rows
        return write_json(name, payload)

    throughput(SMOKE_SHAPES if args.smoke else SHAPES, log, save, smoke=args.smoke)
    if not args.smoke:
        payload["memory"] = memory_table(log)
        write_json(name, payload)
    payload["error_reports"] = error_reports(log, smoke=args.smoke)
    for p in write_json(name, payload):
        log(f"wrote {p}")
    json.dumps(payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
