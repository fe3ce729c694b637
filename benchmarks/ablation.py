"""Where the time goes: kernels timed with one piece of work patched out (diagnostic, GPU).

Usage (GPU machine, repo root):
    PYTHONPATH=. python benchmarks/ablation.py            # B4 H32 S4096 D128
    PYTHONPATH=. python benchmarks/ablation.py --smoke    # tiny shapes, interpret mode (checks the script)

Each variant replaces one function *at trace time* (``unittest.mock.patch`` on the
kernel module, then ``jax.clear_caches()``), so the outputs of a variant are wrong
by design: the numbers say what a piece costs, not what the library computes.

* SageBwd backward from the forward's residuals: full; without the dQ kernel;
  without the dK/dV kernel (each replaced by a kernel storing zeros).
* Attn-QAT forward kernel on bf16 operands: with and without O' (the third MMA);
  with FQ(P) replaced by the identity, or computed with one scale per row (the
  same element-wise rounding without the (rows, keys/16, 16) group reshape).
Writes benchmarks/results/ablation.json (and $OUT/ablation.json).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import types
import warnings
from unittest import mock

import jax
import jax.numpy as jnp

import lowbit_jax as lb
from benchmarks.attention import make_inputs
from benchmarks.common import environment, time_fn, write_json
from pallas_kernels.numerics import nvfp4
from pallas_kernels import qat_fwd, sage_bwd

warnings.filterwarnings("ignore", category=DeprecationWarning)


def _zeros_kernel(n_out: int):
    """A kernel with any signature that stores zeros into its last ``n_out`` refs."""

    def kernel(*refs, **_):
        for ref in refs[-n_out:]:
            ref[...] = jnp.zeros(ref.shape, ref.dtype)

    return kernel


_IDENTITY_FQ = types.SimpleNamespace(fake_quant_last=lambda x, nonnegative=False: x)


def _row_scale_fq(x, nonnegative=False):
    """FQ(P)'s element-wise rounding with one scale per row instead of per 16 keys (no group reshape)."""
    sf = nvfp4.e4m3_round(jnp.max(x, axis=-1, keepdims=True) / nvfp4.E2M1_MAX)
    sf = jnp.where(sf == 0.0, 1.0, sf)
    return nvfp4.e2m1_round(x * (1.0 / sf)) * sf


_ROW_SCALE_FQ = types.SimpleNamespace(fake_quant_last=_row_scale_fq)


def _timed(label, fn, args, log, smoke, module=None, **replacements):
    """Time ``fn(*args)`` with ``module``'s attributes replaced (traced afresh: caches cleared)."""
    jax.clear_caches()
    with mock.patch.multiple(module, **replacements) if module is not None else contextlib.nullcontext():
        ms = time_fn(fn, *args, warmup=1, iters=2 if smoke else 10, batches=3)
    log(f"  {label:48s} {ms:8.3f} ms")
    return dict(variant=label, ms=ms)


def sage_rows(b, h, s, d, log, smoke):
    from lowbit_jax.sage import _backward, _forward, resolve_options

    q, k, v = make_inputs(jax.random.PRNGKey(3), b, h, s, d)
    do = jax.random.normal(jax.random.PRNGKey(4), q.shape, q.dtype)
    extra = dict(implementation="pallas", interpret=True) if smoke else {}
    opts = resolve_options(q, k, v, causal=False, **extra)
    o, lse, ops = _forward(q, k, v, opts=opts, transposed=True)
    bwd = jax.jit(lambda ops, o, lse, do: _backward(ops, o, lse, do, opts=opts))
    args = (ops, o, lse, do)
    return [
        _timed("sage bwd: full", bwd, args, log, smoke),
        _timed("sage bwd: dQ kernel stores zeros", bwd, args, log, smoke, sage_bwd, _dq_kernel=_zeros_kernel(1)),
        _timed("sage bwd: dK/dV kernel stores zeros", bwd, args, log, smoke, sage_bwd,
               _dkdv_kernel=_zeros_kernel(2)),
    ]


def qat_rows(b, h, s, d, log, smoke):
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    qf, kf, vf = (jax.random.normal(kk, (b, h, s, d), jnp.bfloat16) for kk in keys)
    cfg = lb.QatConfig().fitted(s, s)
    rows = []
    for with_aux in (False, True):
        fwd = jax.jit(lambda qf, kf, vf, with_aux=with_aux: qat_fwd.qat_attention_fwd(
            qf, kf, vf, sq_len=s, sk_len=s, causal=False, scale=d**-0.5, out_dtype=jnp.bfloat16, config=cfg,
            with_aux=with_aux, interpret=smoke))
        tag = "with O'" if with_aux else "no O'"
        rows.append(_timed(f"qat fwd kernel ({tag}): full", fwd, (qf, kf, vf), log, smoke))
        rows.append(_timed(f"qat fwd kernel ({tag}): FQ(P) = identity", fwd, (qf, kf, vf), log, smoke, qat_fwd,
                           nvfp4=_IDENTITY_FQ))
        rows.append(_timed(f"qat fwd kernel ({tag}): FQ(P) one scale per row", fwd, (qf, kf, vf), log, smoke,
                           qat_fwd, nvfp4=_ROW_SCALE_FQ))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode; runs anywhere")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.smoke:
        print("benchmarks/ablation.py needs a GPU (or --smoke)")
        return 2
    shape = (1, 2, 128, 64) if args.smoke else (4, 32, 4096, 128)

    def log(msg):
        print(msg, flush=True)

    log(f"# {environment()} B{shape[0]} H{shape[1]} S{shape[2]} D{shape[3]} non-causal bf16")
    rows = sage_rows(*shape, log, args.smoke) + qat_rows(*shape, log, args.smoke)
    payload = dict(env=environment(), command="PYTHONPATH=. python benchmarks/ablation.py",
                   shape=dict(zip("bhsd", shape)), rows=rows)
    for p in write_json("ablation_smoke" if args.smoke else "ablation", payload):
        log(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
