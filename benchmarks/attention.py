"""Attention forward benchmark on the GPU: sage (INT8) vs cuDNN bf16/FP8, XLA, JAX's Pallas mha.

Usage (on the GPU machine, repo root):
    PYTHONPATH=. python benchmarks/attention.py            # sweep tiles, full table, accuracy
    PYTHONPATH=. python benchmarks/attention.py --quick    # two shapes, for iterating
    PYTHONPATH=. python benchmarks/attention.py --quant-sweep   # the quantize kernels' warps alone
    PYTHONPATH=. python benchmarks/attention.py --pv-formats    # the whole op with INT8 vs e4m3 P·V

Prints tables and writes benchmarks/results/attention.json (and $OUT/attention.json);
``python benchmarks/render_results.py`` turns the JSON into RESULTS.md.
TFLOP/s count 4·B·H·Sq·Sk·D (halved if causal) for every method, INT8 included.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import lowbit_jax as lb
from benchmarks.common import (attention_flops, carried_part, environment, fwd_bwd, rerun_part, time_fn,
                               time_rounds, write_json)
from lowbit_jax import sage as sage_mod, sage_backends
from pallas_kernels import quantize
from pallas_kernels.configs import SageFwdConfig, sage_fwd_config

warnings.filterwarnings("ignore", category=DeprecationWarning)

# (B, H, S, D, causal)
FULL_SHAPES = [(4, 32, s, 128, c) for s in (1024, 2048, 4096, 8192, 16384) for c in (False, True)] + [
    (1, 32, 16384, 128, False),
    (1, 32, 16384, 128, True),
    (8, 32, 2048, 64, False),
    (8, 32, 2048, 64, True),
    (4, 32, 4096, 64, False),
    (4, 32, 4096, 64, True),
]
QUICK_SHAPES = [(4, 32, 4096, 128, False), (4, 32, 4096, 128, True)]
# (block_q, block_k, warps, stages)
SWEEP_D128 = [(64, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 256, 4, 2), (128, 256, 8, 2)]
SWEEP_D64 = [(128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)]
XLA_SCORE_BYTES_LIMIT = 60e9
#: (B, H, S, D) and warps of the quantize kernels' sweep (``--quant-sweep``)
QUANT_SHAPES = [(4, 32, 4096, 128), (1, 32, 16384, 128), (8, 32, 2048, 64)]
QUANT_WARPS = (2, 4, 8, 16)
#: (B, H, S, D, causal) of ``--pv-formats``: the shapes of the SageAttention issue, both masks
PV_SHAPES = [(4, 32, 4096, 128, c) for c in (False, True)] + [(1, 32, 16384, 128, c) for c in (False, True)] + [
    (8, 32, 2048, 64, c) for c in (False, True)]
#: (B, H, S, D, K outlier) of ``--pv-formats``' accuracy against exact float64 attention (the issue's gate shape)
PV_ACCURACY = [(1, 8, 4096, 128, 0.0), (1, 8, 4096, 128, 10.0)]
PV_ROUNDS = 5


def make_inputs(key, b, h, s, d, dtype=jnp.bfloat16, k_outlier=0.0):
    kq, kk, kv, km = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, s, h, d), jnp.float32)
    k = jax.random.normal(kk, (b, s, h, d), jnp.float32)
    if k_outlier:
        k = k + k_outlier * jax.random.normal(km, (b, 1, h, d), jnp.float32)
    v = jax.random.normal(kv, (b, s, h, d), jnp.float32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def methods(d: int, causal: bool, config: SageFwdConfig):
    """name → jitted f(q, k, v)."""
    scale = d**-0.5
    out = {
        "sage": jax.jit(functools.partial(lb.sage_attention, causal=causal, config=config)),
        "cudnn_bf16": jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                                implementation="cudnn")),
        "xla_bf16": jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="xla")),
    }
    try:
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        out["pallas_mha_bf16"] = jax.jit(functools.partial(
            pallas_attention.mha, segment_ids=None, sm_scale=scale, causal=causal))
    except Exception:  # noqa: BLE001
        pass
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        one = jnp.ones((1, 1, 1, 1), jnp.float32)
        params = {name: one for name in fa.fp8_params_keys}
        mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK

        def fp8(q, k, v):
            q8, k8, v8 = (x.astype(jnp.float8_e4m3fn) for x in (q, k, v))
            return fa.dot_product_attention(q8, k8, v8, fp8_params=params, scale=scale, mask_type=mask,
                                            use_fp8=True)[0]

        out["cudnn_fp8"] = jax.jit(fp8)
    except Exception:  # noqa: BLE001
        pass
    return out


def sage_parts(q, k, v, causal, config, interpret=False, backend="library"):
    """Jitted (quantize, kernel-only) pair for timing the two stages apart, the quantized operands, and the name
    of the attention kernel timed: with ``backend="library"`` the one ``lb.sage_attention`` runs for this call
    (``sage.attend_quantized``: the Mosaic GPU forward where ``fwd_backend`` picks it, head dims 64 and 128 on
    Hopper), with ``backend="triton"`` always the Triton kernel (what the tile sweep tunes)."""
    if backend == "triton":
        config = dataclasses.replace(config, fwd_backend="triton")
    opts = sage_mod.resolve_options(q, k, v, causal=causal, scale=None, smooth_k=True, smooth_q=False,
                                    qk_granularity="per_block", implementation="pallas", interpret=interpret,
                                    config=config)
    call = sage_backends.SageCall.of_inputs(q, k, opts)
    forward, v_order = sage_backends.forward_for(call), sage_backends.orders_for(call).v  # as the library picks
    quant = jax.jit(lambda q, k, v: forward.quantize(q, k, v, None, opts, transposed=False, v_order=v_order,
                                                     q_t_order=False))
    ops = jax.block_until_ready(quant(q, k, v))
    kern = jax.jit(lambda o: forward.attend(o, None, opts, q.dtype, v_order)[0])
    return quant, kern, ops, forward.name


def sweep(shapes, configs_for_d, log):
    """Kernel-only time of each tile config; returns best config per (d, causal)."""
    best, rows = {}, []
    for b, h, s, d, causal in shapes:
        q, k, v = make_inputs(jax.random.PRNGKey(1), b, h, s, d)
        flops = attention_flops(b, h, s, s, d, causal)
        for bq, bk, w, st in configs_for_d(d):
            cfg = SageFwdConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
            try:
                _, kern, ops, _ = sage_parts(q, k, v, causal, cfg, backend="triton")
                ms = time_fn(kern, ops)
                tops = flops / ms / 1e9
            except Exception as e:  # noqa: BLE001
                log(f"  sweep {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            rows.append(dict(b=b, h=h, s=s, d=d, causal=causal, config=dataclasses.asdict(cfg), ms=ms, tops=tops))
            log(f"  sweep B{b} H{h} S{s} D{d} causal={causal} {bq}x{bk} w{w} s{st}: {ms:.3f} ms {tops:.0f} TOPS")
            key = (d, causal)
            if key not in best or ms < best[key][1]:
                best[key] = (cfg, ms)
    return {k: v[0] for k, v in best.items()}, rows


def quant_sweep(shapes, log):
    """Each quantize kernel of the forward alone, by warps: Q's, K/V's (V̂ᵀ in operand order, as the Mosaic forward
    takes it) and K/V's with the backward's K̂ᵀ too. ms and GB/s of the bytes it reads and writes (16-bit in,
    INT8 out; the scales are left out: under 1%)."""
    rows = []
    for b, h, s, d in shapes:
        q, k, v = make_inputs(jax.random.PRNGKey(0), b, h, s, d)
        n = b * h * s * d
        cfg = sage_fwd_config(d, False)
        k_mean, v_scale = jax.jit(functools.partial(quantize.sage_channel_stats, smooth_k=True))(k, v)
        kv = functools.partial(quantize.sage_quantize_kv, block=cfg.block_k, per_block=True, v_operand_order=True)
        kernels = {
            "q": (functools.partial(quantize.sage_quantize_q, block=cfg.block_q, per_block=True, smooth_block=False,
                                    out_scale=d**-0.5), (q,), 3 * n),
            "kv": (kv, (k, v, k_mean, v_scale), 6 * n),
            "kv + K̂ᵀ": (functools.partial(kv, transposed=True), (k, v, k_mean, v_scale), 7 * n),
        }
        for warps in QUANT_WARPS:
            for name, (fn, args, nbytes) in kernels.items():
                ms = time_fn(jax.jit(functools.partial(fn, num_warps=warps)), *args)
                rows.append(dict(b=b, h=h, s=s, d=d, kernel=name, warps=warps, ms=ms, gbps=nbytes / ms / 1e6))
                log(f"  quant B{b} H{h} S{s} D{d} {name} {warps} warps: {ms:.4f} ms {nbytes / ms / 1e6:.0f} GB/s")
    return rows


def pv_formats(shapes, accuracy_cases, log):
    """The whole op (quantization included), forward and fwd+bwd, with ``pv_format`` "int8" and "e4m3" (the rest of
    the device's ``sage_fwd_config``) against cuDNN bf16, interleaved rounds; and O, dQ, dK, dV cos-sim of each
    against exact float64 attention (jax x64 on the GPU), non-causal and causal."""
    rows, acc = [], []
    for b, h, s, d, causal in shapes:
        q, k, v = make_inputs(jax.random.PRNGKey(0), b, h, s, d)
        do = jax.random.normal(jax.random.PRNGKey(5), q.shape, jnp.float32).astype(q.dtype)
        base = sage_fwd_config(d, causal)
        fwd = {"cudnn": jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                                  implementation="cudnn"))}
        fwd.update({fmt: jax.jit(functools.partial(lb.sage_attention, causal=causal,
                                                   config=dataclasses.replace(base, pv_format=fmt)))
                    for fmt in ("int8", "e4m3")})
        timed = {name: (f, (q, k, v)) for name, f in fwd.items()}
        timed.update({f"{name} fwd+bwd": (fwd_bwd(f), (q, k, v, do)) for name, f in fwd.items()})
        ms, _ = time_rounds(timed, PV_ROUNDS)
        rows.append(dict(b=b, h=h, s=s, d=d, causal=causal, ms=ms, rounds=PV_ROUNDS))
        log(f"  pv B{b} H{h} S{s} D{d} causal={causal}: " + " ".join(f"{n} {t:.3f}" for n, t in ms.items()))
    for b, h, s, d, outlier in accuracy_cases:
        q, k, v = make_inputs(jax.random.PRNGKey(7), b, h, s, d, k_outlier=outlier)
        do = jax.random.normal(jax.random.PRNGKey(8), q.shape, jnp.float32).astype(q.dtype)
        for causal in (False, True):
            with jax.enable_x64(True):
                exact = [np.asarray(x) for x in fwd_bwd(functools.partial(_exact_f64, causal=causal))(
                    *(x.astype(jnp.float64) for x in (q, k, v, do)))]
            for fmt in ("int8", "e4m3"):
                cfg = dataclasses.replace(sage_fwd_config(d, causal), pv_format=fmt)
                got = fwd_bwd(lambda q, k, v: lb.sage_attention(q, k, v, causal=causal, config=cfg))(q, k, v, do)
                cos = {name: float(lb.cos_sim(g, w)) for name, g, w in zip(("o", "dq", "dk", "dv"), got, exact)}
                acc.append(dict(b=b, h=h, s=s, d=d, k_outlier=outlier, causal=causal, pv_format=fmt, cos=cos))
                log(f"  pv accuracy B{b} H{h} S{s} D{d} outlier {outlier} causal={causal} {fmt}: {cos}")
    return rows, acc


def _exact_f64(q, k, v, causal):
    """Softmax attention in float64 (x64 on; equal head counts, Sq = Sk): the accuracy reference."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def accuracy(b, h, s, d, causal, config, log):
    rows = []
    for label, outlier in (("normal", 0.0), ("k_outlier_10x", 10.0)):
        q, k, v = make_inputs(jax.random.PRNGKey(7), b, h, s, d, k_outlier=outlier)
        ref = jax.jit(functools.partial(lb.reference_attention, causal=causal))(q, k, v)
        variants = {
            "sage(smooth_k)": functools.partial(lb.sage_attention, causal=causal, config=config),
            "sage(no smooth)": functools.partial(lb.sage_attention, causal=causal, config=config, smooth_k=False),
            "sage(per_token)": functools.partial(lb.sage_attention, causal=causal, config=config,
                                                 qk_granularity="per_token"),
            "sage(smooth_q+k)": functools.partial(lb.sage_attention, causal=causal, config=config, smooth_q=True),
            "sage xla-ref": functools.partial(lb.sage_attention, causal=causal, config=config, implementation="xla"),
            "cudnn_bf16": functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn"),
        }
        fp8 = methods(d, causal, config).get("cudnn_fp8")
        if fp8 is not None:
            variants["cudnn_fp8"] = fp8
        outs = {}
        for name, fn in variants.items():
            try:
                out = jax.jit(fn)(q, k, v)
                outs[name] = out
                m = lb.error_metrics(out, ref)
                m["nan"] = bool(jnp.any(jnp.isnan(out.astype(jnp.float32))))
            except Exception as e:  # noqa: BLE001
                m = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            rows.append(dict(b=b, h=h, s=s, d=d, causal=causal, inputs=label, method=name, **m))
            log(f"  acc {label:14s} {name:18s} {m}")
        if "sage(smooth_k)" in outs and "sage xla-ref" in outs:
            m = lb.error_metrics(outs["sage(smooth_k)"], outs["sage xla-ref"])
            rows.append(dict(b=b, h=h, s=s, d=d, causal=causal, inputs=label, method="kernel vs xla-ref", **m))
            log(f"  acc {label:14s} kernel vs xla-ref  {m}")
    return rows


def check_small(log):
    """Compiled kernels vs the xla reference (same quantization) on awkward shapes."""
    rows = []
    cases = [(2, 100, 77, 4, 2, 64, True), (1, 300, 300, 4, 1, 128, False), (2, 129, 257, 8, 2, 128, True),
             (1, 200, 100, 2, 2, 64, True), (1, 64, 1000, 4, 4, 128, False)]
    for b, sq, sk, hq, hkv, d, causal in cases:
        kq, kk, kv = jax.random.split(jax.random.PRNGKey(sq * sk), 3)
        q = jax.random.normal(kq, (b, sq, hq, d), jnp.bfloat16)
        k = jax.random.normal(kk, (b, sk, hkv, d), jnp.bfloat16) + 2.0
        v = jax.random.normal(kv, (b, sk, hkv, d), jnp.bfloat16)
        for gran, smooth_q in (("per_block", False), ("per_token", True)):
            kw = dict(causal=causal, qk_granularity=gran, smooth_q=smooth_q)
            o_p, l_p, _ = lb.sage_forward(q, k, v, implementation="pallas", **kw)
            o_x, l_x, _ = lb.sage_forward(q, k, v, implementation="xla", **kw)
            ref = lb.reference_attention(q, k, v, causal=causal)
            fin = jnp.isfinite(l_x)
            row = dict(case=(b, sq, sk, hq, hkv, d, causal), gran=gran, smooth_q=smooth_q,
                       kernel_vs_xla=lb.error_metrics(o_p, o_x), kernel_vs_exact=lb.error_metrics(o_p, ref),
                       lse_maxdiff=float(jnp.max(jnp.abs(jnp.where(fin, l_p - l_x, 0.0)))),
                       lse_inf_match=bool(jnp.all(jnp.isinf(l_p) == jnp.isinf(l_x))),
                       nan=bool(jnp.any(jnp.isnan(o_p.astype(jnp.float32)))))
            rows.append(row)
            log(f"  check {row}")
    return rows


def throughput(shapes, best, log, save=lambda rows: None):
    rows = []
    for b, h, s, d, causal in shapes:
        cfg = best.get((d, causal)) or sage_fwd_config(d, causal)
        q, k, v = make_inputs(jax.random.PRNGKey(3), b, h, s, d)
        flops = attention_flops(b, h, s, s, d, causal)
        row = dict(b=b, h=h, s=s, d=d, causal=causal, config=dataclasses.asdict(cfg))
        for name, fn in methods(d, causal, cfg).items():
            if name == "xla_bf16" and b * h * s * s * 4 * 3 > XLA_SCORE_BYTES_LIMIT:
                row[name] = None
                continue
            try:
                row[name] = time_fn(fn, q, k, v)
            except Exception as e:  # noqa: BLE001
                log(f"  {name} failed at B{b} S{s} D{d} causal={causal}: {type(e).__name__}: {str(e)[:300]}")
                row[name] = None
        try:
            quant, kern, ops, row["kernel_backend"] = sage_parts(q, k, v, causal, cfg)
            row["sage_kernel_only"] = time_fn(kern, ops)
            row["sage_quantize_only"] = time_fn(quant, q, k, v)
        except Exception as e:  # noqa: BLE001
            log(f"  sage parts failed: {e}")
        times = {m: t for m, t in row.items() if isinstance(t, float)}
        row["tflops"] = {m: flops / t / 1e9 for m, t in times.items() if m != "sage_quantize_only"}
        base = row.get("cudnn_bf16")
        row["vs_cudnn_bf16"] = {m: base / t for m, t in times.items()} if base else {}
        rows.append(row)
        tf = row["tflops"]
        log(f"B{b} H{h} S{s} D{d} causal={causal!s:5} " + " ".join(
            f"{m}={v:.0f}" for m, v in tf.items() if v is not None) +
            f" | sage/cudnn={row['vs_cudnn_bf16'].get('sage') or float('nan'):.2f}")
        save(rows)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two shapes only")
    parser.add_argument("--no-sweep", action="store_true", help="use the configs' heuristic instead of a sweep")
    parser.add_argument("--name", default="attention", help="results file name")
    parser.add_argument("--skip-checks", action="store_true", help="skip the small-shape correctness checks")
    parser.add_argument("--quant-sweep", action="store_true",
                        help="only the quantize kernels by warps, written to <name>_quant_sweep.json")
    parser.add_argument("--pv-formats", action="store_true",
                        help="only the op with INT8 vs e4m3 P·V against cuDNN, written to <name>_pv_formats.json")
    parser.add_argument("--checks-only", action="store_true",
                        help="only the small-shape correctness checks, written into the existing results file")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("benchmarks/attention.py needs a GPU (default backend is %s)" % jax.default_backend())
        return 2

    def log(msg):
        print(msg, flush=True)

    env = environment()
    log(f"# {env}")
    if args.quant_sweep:
        payload = dict(env=env, command="PYTHONPATH=. python benchmarks/attention.py --quant-sweep",
                       rows=quant_sweep(QUANT_SHAPES, log))
        for p in write_json(f"{args.name}_quant_sweep", payload):
            log(f"wrote {p}")
        return 0
    if args.pv_formats:
        rows, acc = pv_formats(PV_SHAPES, PV_ACCURACY, log)
        payload = dict(env=env, command="PYTHONPATH=. python benchmarks/attention.py --pv-formats", rows=rows,
                       accuracy=acc)
        for p in write_json(f"{args.name}_pv_formats", payload):
            log(f"wrote {p}")
        return 0
    if args.checks_only:  # re-run the checks into the existing results file (the table stays as it was)
        payload = rerun_part(args.name, "checks", check_small(log),
                             command="PYTHONPATH=. python benchmarks/attention.py --checks-only", env=env)
        for p in write_json(args.name, payload):
            log(f"wrote {p}")
        return 0
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    best, sweep_rows = {}, []
    if not args.no_sweep:
        sweep_shapes = [(4, 32, 4096, 128, False), (4, 32, 4096, 128, True)]
        if not args.quick:
            sweep_shapes += [(8, 32, 2048, 64, False), (8, 32, 2048, 64, True)]
        best, sweep_rows = sweep(sweep_shapes, lambda d: SWEEP_D128 if d == 128 else SWEEP_D64, log)
        log(f"# best tiles: { {k: dataclasses.asdict(v) for k, v in best.items()} }")
    # --skip-checks keeps the earlier run's checks, with where they came from
    checks = carried_part(args.name, "checks") if args.skip_checks else dict(checks=check_small(log))
    acc_rows = []
    for causal in (False, True):
        try:
            acc_rows += accuracy(4, 32, 4096, 128, causal, best.get((128, causal)) or sage_fwd_config(128, causal), log)
        except Exception:  # noqa: BLE001
            log(traceback.format_exc())
    payload = dict(env=env, command="PYTHONPATH=. python benchmarks/attention.py " + " ".join(argv or sys.argv[1:]),
                   sweep=sweep_rows, accuracy=acc_rows, throughput=[],
                   best_configs={f"D{k[0]}{'_causal' if k[1] else ''}": dataclasses.asdict(v) for k, v in best.items()},
                   **checks)

    def save(rows):  # after every shape, so a run cut short keeps what it measured
        payload["throughput"] = rows
        return write_json(args.name, payload)

    save([])
    for p in save(throughput(shapes, best, log, save)):
        log(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
