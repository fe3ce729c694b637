"""Attn-QAT benchmark on the GPU: forward and fwd+bwd vs cuDNN bf16 and sage, accuracy vs exact.

Usage (GPU machine, repo root):
    PYTHONPATH=. python benchmarks/qat.py              # tile sweep, throughput table, accuracy
    PYTHONPATH=. python benchmarks/qat.py --smoke      # tiny shapes, any backend (checks the script)
    PYTHONPATH=. python benchmarks/qat.py --no-sweep --skip-checks --shapes 8,32,2048,64,0 --rounds 7 \
        --methods qat_mosaic_pingpong cudnn_bf16 --name qat_rows   # more rounds of some rows, into qat_rows.json

Measures, in one run: compiled kernels vs the xla twin on awkward shapes (forward
and gradients); a small tile sweep of the forward and the backward at
B4 H32 S4096 D128; forward and fwd+bwd time and TFLOP/s (4·B·H·S²·D, halved if
causal; fwd+bwd 3.5×; the methods timed in interleaved rounds, the median kept) of
qat (Triton kernels), qat_mosaic (Pallas Mosaic GPU kernels without the
forward's ping-pong schedule), qat_mosaic_pingpong (with it: the library's default on Hopper,
QatConfig.pingpong), qat with the naive backward, sage and cuDNN bf16;
O and gradient cos-sim / rel-L2 vs exact fp32 on N(0,1) at S=4096.
Writes benchmarks/results/qat.json (and $OUT/qat.json; ``--name`` another name).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import warnings

import jax
import jax.numpy as jnp

import lowbit_jax as lb
from benchmarks.attention import make_inputs
from benchmarks.common import (
    ROUND_WARMUP, ROUNDS, attention_flops, carried_part, compiled_entries, environment, fwd_bwd, time_fn,
    time_rounds, write_json,
)

warnings.filterwarnings("ignore", category=DeprecationWarning)

SHAPES = [(4, 32, 4096, 128, False), (4, 32, 4096, 128, True), (1, 32, 16384, 128, False),
          (1, 32, 16384, 128, True), (8, 32, 2048, 64, False)]
SMOKE_SHAPES = [(1, 2, 128, 64, False)]
# forward (block_q, block_k, warps, stages) and backward (block_q, block_k, warps, stages) candidates
FWD_SWEEP = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 4, 2), (128, 128, 8, 2), (128, 64, 4, 3)]
BWD_SWEEP = [(64, 64, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2),
             (32, 128, 4, 2)]


def qat_fn(causal, config=None, naive=False, **kw):
    return functools.partial(lb.qat_attention, causal=causal, config=config, naive_backward=naive, **kw)


def mosaic_config(d: int, causal: bool, config=None, pingpong: bool = False) -> lb.QatConfig:
    """``config`` (default: the library's for this device, ``lb.qat_config``: 128-key forward tiles on the H200)
    with the forward and backward on Pallas Mosaic GPU; the forward's ping-pong schedule as given (the library
    default is on; off here keeps the column comparable)."""
    return dataclasses.replace(config or lb.qat_config(d, causal), fwd_backend="mosaic", bwd_backend="mosaic",
                               pingpong=pingpong)


def triton_config(config=None) -> lb.QatConfig:
    """``config`` (default: :class:`lb.QatConfig`'s, the Triton kernels' tiles: 128-key forward tiles made the
    Triton forward slower on the H200) with the forward and backward on Pallas Triton."""
    return dataclasses.replace(config or lb.QatConfig(), fwd_backend="triton", bwd_backend="triton")


def method_fns(d, causal, config):
    return {
        "qat": qat_fn(causal, triton_config(config)),
        "qat_mosaic": qat_fn(causal, mosaic_config(d, causal, config)),
        "qat_mosaic_pingpong": qat_fn(causal, mosaic_config(d, causal, config, pingpong=True)),  # the library's
        "qat_naive_bwd": qat_fn(causal, mosaic_config(d, causal, config, pingpong=True), naive=True),
        "sage": functools.partial(lb.sage_attention, causal=causal),
        "cudnn_bf16": functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn"),
    }


def check_kernels(log, smoke):
    rows = []
    impl = dict(implementation="pallas", interpret=True) if smoke else dict(implementation="pallas")
    cases = [(2, 100, 77, 4, 2, 64, True, "triton"), (1, 300, 300, 4, 1, 128, False, "triton"),
             (2, 129, 257, 8, 2, 128, True, "triton"),
             # the Mosaic GPU kernels (Sq ≤ Sk when causal), compiled, against the same twin
             (1, 300, 300, 4, 1, 128, False, "mosaic"), (2, 129, 257, 8, 2, 64, True, "mosaic"),
             (2, 256, 256, 4, 4, 128, True, "mosaic"),
             # the Mosaic forward with FlashAttention-3's ping-pong schedule (QatConfig.pingpong)
             (2, 129, 257, 8, 2, 64, True, "mosaic_pingpong"), (1, 300, 300, 4, 1, 128, False, "mosaic_pingpong")]
    for b, sq, sk, hq, hkv, d, causal, backend in cases[:1] if smoke else cases:
        ks = jax.random.split(jax.random.PRNGKey(sq * sk), 4)
        q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, sk, hkv, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, sk, hkv, d), jnp.bfloat16)
        do = jax.random.normal(ks[3], q.shape, q.dtype)
        config = {"mosaic": mosaic_config(d, causal), "triton": triton_config(),
                  "mosaic_pingpong": mosaic_config(d, causal, pingpong=True)}[backend]
        row = dict(case=(b, sq, sk, hq, hkv, d, causal), backend=backend)
        try:
            g_p = fwd_bwd(qat_fn(causal, config, **impl))(q, k, v, do)
        except Exception as e:  # noqa: BLE001  (recorded; the rest of the run goes on)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            log(f"  {backend} kernels FAILED {row['case']}: {row['error']}")
            continue
        g_x = fwd_bwd(qat_fn(causal, config, implementation="xla"))(q, k, v, do)  # the twin on the kernels' tiles
        for i, name in enumerate(("o", "dq", "dk", "dv")):
            row[name] = lb.error_metrics(g_p[i], g_x[i])
        rows.append(row)
        log(f"  {backend} kernels vs xla " + str(row["case"]) + " " + " ".join(
            f"{n}: rel-L1 {row[n]['rel_l1']:.1e}" for n in ("o", "dq", "dk", "dv")))
    return rows


def sweep(log, smoke):
    b, h, s, d = (1, 2, 256, 64) if smoke else (4, 32, 4096, 128)
    q, k, v = make_inputs(jax.random.PRNGKey(3), b, h, s, d)
    do = jax.random.normal(jax.random.PRNGKey(4), q.shape, q.dtype)
    flops = attention_flops(b, h, s, s, d, False)
    extra = dict(implementation="pallas", interpret=True) if smoke else {}
    rows, best_fwd, best_bwd = [], None, None
    for bq, bk, w, st in FWD_SWEEP[:1] if smoke else FWD_SWEEP:
        cfg = triton_config(lb.QatConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=st))
        try:
            ms = time_fn(jax.jit(qat_fn(False, cfg, **extra)), q, k, v, warmup=1, iters=3 if smoke else 10, batches=3)
        except Exception as e:  # noqa: BLE001
            log(f"  fwd {bq}x{bk} w{w} s{st} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        rows.append(dict(kind="fwd", tile=(bq, bk, w, st), ms=ms, tflops=flops / ms / 1e9))
        log(f"  qat fwd {bq}x{bk} w{w} s{st}: {ms:.2f} ms ({flops / ms / 1e9:.0f} TFLOP/s)")
        if best_fwd is None or ms < best_fwd[1]:
            best_fwd = ((bq, bk, w, st), ms)
    bq, bk, w, st = best_fwd[0]
    base = triton_config(lb.QatConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=st))
    for bbq, bbk, bw, bst in BWD_SWEEP[:1] if smoke else BWD_SWEEP:
        cfg = dataclasses.replace(base, bwd_block_q=bbq, bwd_block_k=bbk, bwd_warps=bw, bwd_stages=bst)
        try:
            ms = time_fn(fwd_bwd(qat_fn(False, cfg, **extra)), q, k, v, do, warmup=1, iters=3 if smoke else 10,
                         batches=3)
        except Exception as e:  # noqa: BLE001
            log(f"  bwd {bbq}x{bbk} w{bw} s{bst} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        rows.append(dict(kind="fwd+bwd", tile=(bbq, bbk, bw, bst), ms=ms, tflops=3.5 * flops / ms / 1e9))
        log(f"  qat fwd+bwd, bwd {bbq}x{bbk} w{bw} s{bst}: {ms:.2f} ms ({3.5 * flops / ms / 1e9:.0f} TFLOP/s)")
        if best_bwd is None or ms < best_bwd[1]:
            best_bwd = ((bbq, bbk, bw, bst), ms)
    bbq, bbk, bw, bst = best_bwd[0]
    best = dataclasses.replace(base, bwd_block_q=bbq, bwd_block_k=bbk, bwd_warps=bw, bwd_stages=bst)
    log(f"  best: {best}")
    return rows, best


def throughput(shapes, config, log, save, smoke, methods=None, rounds=ROUNDS, warmup=ROUND_WARMUP):
    rows = []
    for b, h, s, d, causal in shapes:
        q, k, v = make_inputs(jax.random.PRNGKey(3), b, h, s, d)
        do = jax.random.normal(jax.random.PRNGKey(4), q.shape, q.dtype)
        flops = attention_flops(b, h, s, s, d, causal)
        row = dict(b=b, h=h, s=s, d=d, causal=causal, fwd_ms={}, fwd_bwd_ms={}, errors={})
        iters = 3 if (smoke or s * s * b >= 4 * 8192 * 8192) else 10
        fns = {m: fn for m, fn in method_fns(d, causal, config).items() if methods is None or m in methods}
        if smoke:
            fns = {"qat": qat_fn(causal, config, implementation="pallas", interpret=True)}
        def entries(name, fn):  # "kind:method" -> (fn, args); the naive backward's forward is qat's
            fwd = {} if name == "qat_naive_bwd" else {f"fwd:{name}": (jax.jit(fn), (q, k, v))}
            return {**fwd, f"fwd_bwd:{name}": (fwd_bwd(fn), (q, k, v, do))}

        # timed in interleaved rounds once every method has compiled
        timed = compiled_entries({name: entries(name, fn) for name, fn in fns.items()}, row["errors"], log)
        row["rounds"], row["warmup"] = (1 if smoke else rounds), warmup
        ms, row["ms_rounds"] = time_rounds(timed, row["rounds"], warmup=warmup, iters=iters, batches=1)
        for key, t in ms.items():
            kind, name = key.split(":", 1)
            row[f"{kind}_ms"][name] = t
        row["fwd_tflops"] = {m: flops / t / 1e9 for m, t in row["fwd_ms"].items()}
        row["fwd_bwd_tflops"] = {m: 3.5 * flops / t / 1e9 for m, t in row["fwd_bwd_ms"].items()}
        for kind in ("fwd", "fwd_bwd"):
            base = row[f"{kind}_ms"].get("cudnn_bf16")
            row[f"{kind}_vs_cudnn_bf16"] = {m: base / t for m, t in row[f"{kind}_ms"].items()} if base else {}
        rows.append(row)
        log(f"B{b} H{h} S{s} D{d} causal={causal!s:5} fwd " + " ".join(
            f"{m}={v:.0f}" for m, v in row["fwd_tflops"].items()) + " | fwd+bwd " + " ".join(
            f"{m}={v:.0f}" for m, v in row["fwd_bwd_tflops"].items()) + " TFLOP/s")
        save(rows)
    return rows


def accuracy(log, smoke):
    b, h, s, d = (1, 2, 128, 64) if smoke else (1, 8, 4096, 128)
    rows = []
    extra = dict(implementation="pallas", interpret=True) if smoke else {}
    variants = {"normal": (("qat", {}), ("qat naive backward", dict(naive=True))),
                "k_outlier_8x": (("qat", {}), ("qat smooth_k", dict(smooth_k=True)))}
    for inputs, outlier in (("normal", 0.0), ("k_outlier_8x", 8.0)):
        q, k, v = make_inputs(jax.random.PRNGKey(11), b, h, s, d, k_outlier=outlier)
        do = jax.random.normal(jax.random.PRNGKey(12), q.shape, q.dtype)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
        exact = fwd_bwd(lb.reference_attention)(*f32)
        for variant, kw in variants[inputs]:
            got = fwd_bwd(qat_fn(False, **kw, **extra))(q, k, v, do)
            rep = {n: lb.error_metrics(got[i], exact[i]) for i, n in enumerate(("o", "dq", "dk", "dv"))}
            rows.append(dict(b=b, h=h, s=s, d=d, inputs=inputs, variant=variant, metrics=rep))
            log(f"  accuracy {inputs:13s} {variant:20s} " + " ".join(
                f"{n}: cos {m['cos_sim']:.4f} rel-L2 {m['rel_l2']:.3f}" for n, m in rep.items()))
    return rows


def parse_shape(text: str) -> tuple[int, int, int, int, bool]:
    """``"8,32,2048,64,0"`` → (8, 32, 2048, 64, False): a table row (B, H, S, D, causal)."""
    parts = text.split(",")
    if len(parts) != 5 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise ValueError(f"--shapes takes B,H,S,D,CAUSAL (five integers), got {text!r}")
    b, h, s, d, causal = (int(p) for p in parts)
    return b, h, s, d, bool(causal)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs anywhere")
    parser.add_argument("--no-sweep", action="store_true", help="use the default QatConfig")
    parser.add_argument("--methods", nargs="+", choices=tuple(method_fns(64, False, None)), default=None,
                        help="time only these columns (default: all); RESULTS.md leaves the others out")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="B,H,S,D,CAUSAL",
                        help="time only these rows (default: the table's)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved timing rounds per row")
    parser.add_argument("--warmup", type=int, default=ROUND_WARMUP, help="untimed calls before each timed batch")
    parser.add_argument("--skip-checks", action="store_true",
                        help="keep the kernel checks and accuracy of the results file instead of re-running them")
    parser.add_argument("--name", default=None, help="results file name (default qat; qat_smoke with --smoke)")
    args = parser.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = [parse_shape(text) for text in args.shapes]
    if jax.default_backend() != "gpu" and not args.smoke:
        print("benchmarks/qat.py needs a GPU (or --smoke)")
        return 2
    name = args.name or ("qat_smoke" if args.smoke else "qat")
    payload = dict(env=environment(), command="PYTHONPATH=. python benchmarks/qat.py " + " ".join(
        argv if argv is not None else sys.argv[1:]))
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    log(f"# {payload['env']}")
    if args.skip_checks:
        payload.update(carried_part(name, "kernel_checks"))
        payload.update(carried_part(name, "accuracy"))
    else:
        payload["kernel_checks"] = check_kernels(log, args.smoke)
        payload["accuracy"] = accuracy(log, args.smoke)
    write_json(name, payload)
    config = None
    if not args.no_sweep:
        payload["sweep"], config = sweep(log, args.smoke)
        payload["config"] = dataclasses.asdict(config)
        write_json(name, payload)

    def save(rows):
        payload["throughput"] = rows
        write_json(name, payload)

    throughput(shapes, config, log, save, args.smoke, args.methods, rounds=args.rounds, warmup=args.warmup)
    for p in write_json(name, payload):
        log(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
