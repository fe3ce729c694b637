"""Every kernel compiled on the GPU and compared with its reference, on awkward shapes, in one run.

Usage (GPU machine, repo root)::

    PYTHONPATH=. python benchmarks/gpu_check.py [--quick]

For each method and each Pallas backend the call can take (Mosaic GPU on Hopper, Triton), the compiled output and
gradients against the pure-JAX reference of the same quantization (``implementation="xla"``), at ragged lengths,
GQA, causal with Sq ≠ Sk, head dims 64 and 128; the Thrift decode over a cache; non-finite inputs (the compiled
kernels' reductions may treat NaN otherwise than the interpreter: Triton's ``max`` drops it); and the public API
under ``jax_enable_x64``. Prints one line per check and a summary; exits 1 if any check fails. The tolerances are
the test suite's (kernel vs reference: the same quantization, so only accumulation order and exp2 differ).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import lowbit_jax as lb

#: (B, Sq, Sk, Hq, Hkv, D, causal): ragged, GQA, causal with Sq < Sk, both head dims
CASES = [(1, 300, 300, 4, 2, 64, True), (2, 256, 384, 8, 2, 128, True), (1, 384, 384, 4, 4, 128, False),
         (2, 200, 456, 4, 1, 64, False)]
#: largest rel-L1 of the compiled kernels against the reference (same quantization): O and each gradient
TOL = {"sage": 2e-3, "qat": 5e-3, "thrift": 5e-3}


def _qkv(case, seed=0, dtype=jnp.bfloat16):
    b, sq, sk, hq, hkv, d, _ = case
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, hq, d))
    k = rng.standard_normal((b, sk, hkv, d)) + 2.0 * rng.standard_normal((b, 1, hkv, d))  # K channel outliers
    v = rng.standard_normal((b, sk, hkv, d))
    do = rng.standard_normal((b, sq, hq, d))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, do))


def _vjp(fn, q, k, v, do):
    o, pull = jax.vjp(fn, q, k, v)
    return [np.asarray(x, np.float32) for x in (o, *pull(do))]


def _rel(a, b) -> float:
    return float(np.abs(a - b).sum() / max(np.abs(b).sum(), 1e-30))


def backends(method: str, backend: str):
    """The keyword options that put every kernel of ``method`` on ``backend`` ("mosaic e4m3": Sage with
    ``pv_format="e4m3"``)."""
    if method == "sage":
        backend, *fmt = backend.split()
        return dict(config=lb.SageFwdConfig(fwd_backend=backend, dkdv_backend=backend, dq_backend=backend,
                                            pv_format=fmt[0] if fmt else "int8"))
    if method == "qat":
        return dict(config=lb.QatConfig(fwd_backend=backend, bwd_backend=backend))
    return {}


def check_attention(method: str, backend: str, case) -> dict:
    fn = {"sage": lb.sage_attention, "qat": lb.qat_attention,
          "thrift": functools.partial(lb.thrift_attention, budget=0.25)}[method]
    q, k, v, do = _qkv(case, seed=sum(case[:6]))
    kw = dict(causal=case[6], **backends(method, backend))
    if method == "qat":  # one config for both implementations: block_k is part of its numerics
        kw["config"] = dataclass_replace(lb.qat_config(case[5], case[6]), kw["config"])
    got = _vjp(lambda q, k, v: fn(q, k, v, implementation="pallas", **kw), q, k, v, do)
    want = _vjp(lambda q, k, v: fn(q, k, v, implementation="xla", **kw), q, k, v, do)
    errs = {name: _rel(g, w) for name, g, w in zip(("o", "dq", "dk", "dv"), got, want)}
    finite = all(np.isfinite(g).all() for g in got)
    return dict(ok=finite and max(errs.values()) <= TOL[method], rel_l1=errs, finite=finite)


def dataclass_replace(base, override):
    """``base`` with ``override``'s backend fields (QatConfig)."""
    import dataclasses

    return dataclasses.replace(base, fwd_backend=override.fwd_backend, bwd_backend=override.bwd_backend)


def check_decode(t: int, hq: int, d: int, compute_wgs: int = 1) -> dict:
    """The decode over a ragged cache against the xla reference; ``compute_wgs``: the Mosaic 4-bit kernel's
    (``ThriftConfig.decode_compute_wgs``, with four 4-bit runs so that every value runs its producer kernel)."""
    b, s, hkv = 2, 1000, 2
    rng = np.random.default_rng(t + d)
    k, v = (jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.bfloat16)
    cache = lb.ThriftKVCache.create(b, 1024, hkv, d).append(k, v)
    config = None if compute_wgs == 1 else lb.ThriftConfig(decode_splits=4, decode_compute_wgs=compute_wgs)
    got = np.asarray(lb.thrift_decode(q, cache, budget=0.25, implementation="pallas", config=config), np.float32)
    want = np.asarray(lb.thrift_decode(q, cache, budget=0.25, implementation="xla", config=config), np.float32)
    err = _rel(got, want)
    return dict(ok=bool(np.isfinite(got).all()) and err <= TOL["thrift"], rel_l1=err)


def _exact_oracle():
    """The test suite's float64 oracle (tests/oracle/exact.py), in which masked pairs take no part: the reference
    of the non-finite contract (docs/spec.md). ``lb.reference_attention`` would not do: its P·V multiplies a
    masked pair's zero by a NaN in V and reports rows that never see the damaged key."""
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from oracle import exact

    return exact


def check_nonfinite(method: str, backend: str, which: str) -> dict:
    """A NaN in batch 0 and an inf in batch 1 of q, k or v: every output and gradient element that exact attention
    makes non-finite is non-finite in ours, and batch 2 (clean) is finite (as tests/test_nonfinite.py)."""
    case = (3, 256, 256, 4, 2, 64, True)
    q, k, v, do = _qkv(case, seed=11)
    arrays = dict(q=q, k=k, v=v)
    x = np.asarray(arrays[which], np.float32)
    x[0, 70, 0, 3], x[1, 70, 0, 3] = np.nan, np.inf
    arrays[which] = jnp.asarray(x, jnp.bfloat16)
    fn = {"sage": lb.sage_attention, "qat": lb.qat_attention,
          "thrift": functools.partial(lb.thrift_attention, budget=0.25)}[method]
    got = _vjp(lambda q, k, v: fn(q, k, v, causal=True, implementation="pallas", **backends(method, backend)),
               arrays["q"], arrays["k"], arrays["v"], do)
    exact = _exact_oracle()
    q64, k64, v64, do64 = (np.asarray(a, np.float64) for a in (arrays["q"], arrays["k"], arrays["v"], do))
    want = [exact.attention(q64, k64, v64, causal=True), *exact.attention_grads(q64, k64, v64, do64, causal=True)]
    hidden = {name: int((~np.isfinite(w) & np.isfinite(g)).sum())
              for name, g, w in zip(("o", "dq", "dk", "dv"), got, want)}
    clean = all(np.isfinite(g[2]).all() for g in got)
    return dict(ok=not any(hidden.values()) and clean, hidden=hidden, clean_batch_finite=clean)


def check_x64() -> dict:
    q, k, v, do = _qkv((1, 256, 256, 4, 2, 128, True))
    with jax.enable_x64(True):
        outs = {name: _vjp(lambda q, k, v, f=f: f(q, k, v, causal=True), q, k, v, do)
                for name, f in (("sage", lb.sage_attention), ("qat", lb.qat_attention))}
    ok = all(np.isfinite(x).all() and x.dtype == np.float32 for xs in outs.values() for x in xs)
    return dict(ok=ok)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two shape cases only")
    parser.add_argument("--only", nargs="+", metavar="TEXT", help="only the checks whose name contains one of these")
    args = parser.parse_args(argv)
    hopper = getattr(jax.devices()[0], "compute_capability", "") == "9.0"
    cases = CASES[:2] if args.quick else CASES
    checks = []
    for method in ("sage", "qat", "thrift"):
        kernels = ("mosaic", "triton") if hopper and method != "thrift" else ("triton",)
        if method == "sage" and hopper:  # and the FP8 P·V (sage_fwd_config's choice there) on each backend
            kernels += ("mosaic e4m3", "triton e4m3")
        for backend in kernels:
            checks += [(f"{method} {backend} {case}", functools.partial(check_attention, method, backend, case))
                       for case in cases]
            checks += [(f"{method} {backend} non-finite {which}", functools.partial(check_nonfinite, method,
                                                                                     backend, which))
                       for which in ("q", "k", "v")]
    checks += [(f"thrift decode T={t} Hq={hq} D{d}", functools.partial(check_decode, t, hq, d))
               for t, hq, d in ((1, 8, 128), (4, 8, 64), (2, 4, 128))]
    if hopper:  # the Mosaic decode's producer kernel
        checks += [(f"thrift decode T={t} Hq={hq} D{d} compute_wgs={w}", functools.partial(check_decode, t, hq, d, w))
                   for t, hq, d, w in ((1, 8, 128, 2), (4, 8, 64, 4), (2, 4, 128, 2))]
    checks.append(("x64 mode", check_x64))
    if args.only:
        checks = [(name, check) for name, check in checks if any(text in name for text in args.only)]
    results, t0 = {}, time.time()
    for name, check in checks:
        try:
            results[name] = check()
        except Exception as e:  # noqa: BLE001 — a failing compile is a failed check, reported in one line
            results[name] = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
        print(f"{'ok  ' if results[name]['ok'] else 'FAIL'} {name}: "
              f"{json.dumps({k: v for k, v in results[name].items() if k != 'ok'})}", flush=True)
    failed = [n for n, r in results.items() if not r["ok"]]
    print(f"{len(results) - len(failed)} of {len(results)} checks passed in {time.time() - t0:.0f} s on "
          f"{jax.devices()[0].device_kind}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
