"""dQ inside the dK/dV kernel (``dq_kernel="fused"``) vs the separate dQ kernel, SageBwd and Attn-QAT, on the GPU.

Usage (GPU machine, repo root):
    PYTHONPATH=. python benchmarks/dq_kernel.py            # checks + fwd+bwd times
    PYTHONPATH=. python benchmarks/dq_kernel.py --smoke    # tiny shapes (checks the script; any backend)
    PYTHONPATH=. python benchmarks/dq_kernel.py --head-dim 128  # only D128; the D64 rows carried from the file

The fused backward reduce-adds each step's dS·K into a float32 dQ with TMA (FlashAttention-3's
accumulation) instead of running a second kernel that recomputes S, P and dP. In one run:
compiled gradients of both against each other and against the xla reference (rel-L1), then
fwd+bwd time of sage and qat with ``dq_kernel`` "separate" and "fused" beside cuDNN bf16.
SageBwd fuses with per-block Q/K scales and per-tile dS (``sage_bwd_mosaic.supports_fused_dq``; the
defaults) on the Mosaic dK/dV kernel: its "fused" column forces that backend, "separate" is the
library's default backends.
Writes benchmarks/results/dq_kernel.json (and $OUT/dq_kernel.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

import lowbit_jax as lb
from benchmarks.attention import make_inputs
from benchmarks.attention_bwd import attention_fn
from benchmarks.common import RESULTS_DIR, attention_flops, environment, fwd_bwd, time_fn, write_json

warnings.filterwarnings("ignore", category=DeprecationWarning)

CHECKS = [  # (B, Sq, Sk, Hq, Hkv, D, causal): ragged, GQA, causal (bottom-right), D64 and D128
    (2, 380, 512, 4, 2, 64, False), (2, 1024, 1024, 10, 5, 64, True), (1, 2048, 2048, 8, 8, 64, False),
    (2, 129, 257, 8, 2, 128, True), (2, 380, 512, 4, 2, 128, False)]
SHAPES = [  # (B, Hq, Hkv, S, D, causal); (16, 10, 5, 2048, 64, causal) is the 50m training model's attention
    (8, 32, 32, 2048, 64, False), (8, 32, 32, 2048, 64, True), (16, 10, 5, 2048, 64, True),
    (2, 32, 32, 8192, 64, False), (4, 32, 32, 4096, 128, False), (4, 32, 32, 4096, 128, True),
    (1, 32, 32, 16384, 128, False)]
SMOKE_CHECKS = [(1, 128, 256, 4, 2, 64, True)]
SMOKE_SHAPES = [(1, 2, 2, 256, 64, False)]


def method_fn(method: str, causal: bool, dq_kernel: str, **kw):
    """sage or qat attention with ``dq_kernel`` set (library defaults otherwise)."""
    if method == "sage":  # fused needs the Mosaic dK/dV kernel (what "auto" picks on the H200)
        mosaic = dq_kernel == "fused" and not kw.get("interpret")  # (the smoke run: no Mosaic interpreter)
        cfg = dataclasses.replace(lb.sage_fwd_config(kw.pop("d"), causal), dq_kernel=dq_kernel,
                                  **(dict(dkdv_backend="mosaic") if mosaic else {}))
        return functools.partial(lb.sage_attention, causal=causal, config=cfg, **kw)
    cfg = dataclasses.replace(lb.qat_config(kw.pop("d"), causal), dq_kernel=dq_kernel)  # the device's tuned tiles
    return functools.partial(lb.qat_attention, causal=causal, config=cfg, **kw)


def rel_l1(a, r) -> float:  # lowbit_jax.reference.rel_l1 as a Python float (JSON)
    return float(lb.rel_l1(a, r))


def checks(cases, interpret: bool) -> list[dict]:
    rows = []
    for b, sq, sk, hq, hkv, d, causal in cases:
        ks = jax.random.split(jax.random.key(sq + d), 4)
        q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, sk, hkv, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, sk, hkv, d), jnp.bfloat16)
        do = jax.random.normal(ks[3], (b, sq, hq, d), jnp.bfloat16)
        for method in ("sage", "qat"):
            run = {m: fwd_bwd(method_fn(method, causal, m, d=d, interpret=interpret))(q, k, v, do)
                   for m in ("fused", "separate")}
            xla = fwd_bwd(method_fn(method, causal, "separate", d=d, implementation="xla"))(q, k, v, do)
            row = dict(case=[b, sq, sk, hq, hkv, d, causal], method=method,
                       fused_vs_separate=[rel_l1(a, r) for a, r in zip(run["fused"][1:], run["separate"][1:])],
                       fused_vs_xla=[rel_l1(a, r) for a, r in zip(run["fused"][1:], xla[1:])],
                       separate_vs_xla=[rel_l1(a, r) for a, r in zip(run["separate"][1:], xla[1:])],
                       finite=all(bool(jnp.all(jnp.isfinite(x))) for x in run["fused"]))
            rows.append(row)
            print("check", row, flush=True)
    return rows


def timings(shapes, interpret: bool) -> list[dict]:
    rows = []
    for b, h, hkv, s, d, causal in shapes:
        q, k, v = make_inputs(jax.random.key(0), b, h, s, d)
        k, v = k[:, :, :hkv], v[:, :, :hkv]
        do = jax.random.normal(jax.random.key(1), q.shape, q.dtype)
        ms = {}
        if hkv == h and not interpret:
            ms["cudnn"] = time_fn(fwd_bwd(attention_fn("cudnn_bf16", d, causal)), q, k, v, do)
        for method in ("sage", "qat"):
            for mode in ("separate", "fused"):
                fn = fwd_bwd(method_fn(method, causal, mode, d=d, interpret=interpret))
                ms[f"{method}_{mode}"] = time_fn(fn, q, k, v, do, warmup=1, iters=1, batches=1) if interpret \
                    else time_fn(fn, q, k, v, do)
        row = dict(shape=[b, h, hkv, s, d, causal], ms=ms, tflops={
            n: 3.5 * attention_flops(b, h, s, s, d, causal) / t / 1e9 for n, t in ms.items()})
        rows.append(row)
        print("time", row, flush=True)
    return rows


def carry_rows(path: Path, keep) -> dict:
    """The checks and timing rows of an earlier results file whose head dim satisfies ``keep``, each
    marked ``carried_from`` (the date of the run that measured it; kept if already carried)."""
    if not path.exists():
        return dict(checks=[], rows=[])
    old = json.loads(path.read_text())
    date = old["env"]["date"]
    mark = lambda r: r | dict(carried_from=r.get("carried_from", date))  # noqa: E731
    return dict(checks=[mark(c) for c in old["checks"] if keep(c["case"][5])],
                rows=[mark(r) for r in old["rows"] if keep(r["shape"][4])])


def sort_rows(rows: list[dict]) -> list[dict]:
    """Timing rows in the order of :data:`SHAPES` (others last)."""
    order = {tuple(s): i for i, s in enumerate(SHAPES)}
    return sorted(rows, key=lambda r: order.get(tuple(r["shape"]), len(order)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs anywhere (interpret off the GPU)")
    parser.add_argument("--head-dim", type=int, choices=(64, 128),
                        help="re-run only the checks and shapes of this head dim; the other rows are carried "
                             "from the results file, marked with the date of their run")
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.smoke:
        print("benchmarks/dq_kernel.py needs a GPU (or --smoke)")
        return 2
    interpret = not on_gpu
    payload = dict(env=environment(), command="PYTHONPATH=. python benchmarks/dq_kernel.py " + " ".join(
        argv if argv is not None else sys.argv[1:]))
    name = "dq_kernel_smoke" if args.smoke else "dq_kernel"
    cases, shapes = (SMOKE_CHECKS, SMOKE_SHAPES) if args.smoke else (CHECKS, SHAPES)
    carried = dict(checks=[], rows=[])
    if args.head_dim:
        cases = [c for c in cases if c[5] == args.head_dim]
        shapes = [s for s in shapes if s[4] == args.head_dim]
        carried = carry_rows(RESULTS_DIR / f"{name}.json", lambda d: d != args.head_dim)
    payload["checks"] = checks(cases, interpret) + carried["checks"]
    payload["rows"] = []
    for shape in shapes:  # written after each row: a cut-off run keeps its rows
        payload["rows"] += timings([shape], interpret)
        write_json(name, payload | dict(rows=sort_rows(payload["rows"] + carried["rows"])))
    bad = [c for c in payload["checks"] if not c["finite"] or max(c["fused_vs_separate"]) > 1e-3]
    if bad:
        print("fused and separate gradients differ:", bad)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
