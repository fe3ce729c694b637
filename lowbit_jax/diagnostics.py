"""Per-intermediate error report of a low-bit attention method against exact fp32.

The SageBwd paper's table: cos-sim and relative L2 error of D, P, dP, dS, O, dQ,
dK, dV. Run it on your own activations (q, k, v and an output cotangent dO) to
see where the quantization error enters.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit_jax._x32 import x32
from lowbit_jax import _checks
from pallas_kernels.numerics import smoothing
from lowbit_jax.qat import kv_lane_order, qat_attention, qat_forward, resolve_qat_options
from lowbit_jax.qat_backends import kv_in_key_order
from lowbit_jax.qat_reference import qat_backward_reference
from lowbit_jax.reference import causal_mask, error_metrics, reference_attention
from lowbit_jax.sage import _forward, resolve_options, sage_attention
from lowbit_jax.sage_reference import sage_backward_reference, smoothing_bias

METHODS = ("sage", "qat")
ORDER = ("O", "D", "P", "dP", "dS", "dQ", "dK", "dV")


def _exact_intermediates(q, k, v, do, *, causal, scale):
    """fp32 P, dP, D, dS (B, H, Sq, Sk), O and the gradients of exact attention."""
    f = functools.partial(reference_attention, causal=causal, scale=scale)
    o, vjp = jax.vjp(f, q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    dq, dk, dv = vjp(do.astype(jnp.float32))
    group = q.shape[2] // k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), group, axis=2)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf, precision=hi) * scale
    if causal:
        s = jnp.where(causal_mask(q.shape[1], k.shape[1]), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(jnp.isnan(p), 0.0, p)
    dof = do.astype(jnp.float32)
    dp = jnp.einsum("bqhd,bkhd->bhqk", dof, vf, precision=hi)
    delta = jnp.einsum("bqhd,bqhd->bhq", dof, o, precision=hi)
    ds = p * (dp - delta[..., None])
    return {"O": o, "D": delta, "P": p, "dP": dp, "dS": ds, "dQ": dq, "dK": dk, "dV": dv}


@x32
def attention_error_report(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    do: jax.Array,
    *,
    method: str = "sage",
    print_table: bool = True,
    **options: Any,
) -> dict[str, dict[str, float]]:
    """Error of each attention intermediate against exact fp32 attention.

    O, dQ, dK, dV come from the method as configured (``options`` as for
    :func:`lowbit_jax.sage_attention` or :func:`lowbit_jax.qat_attention`, e.g.
    ``causal``, ``smooth_k``, ``naive_backward``, ``implementation``); D, P, dP, dS
    from its pure-JAX reference with the same quantization (the kernels do not
    expose them). Materializes (B, H, Sq, Sk)
    matrices: use it at diagnostic sizes.

    Args:
      q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D); do: (B, Sq, Hq, D), q's dtype.
      method: "sage" (INT8 SageAttention/SageBwd) or "qat" (NVFP4 Attn-QAT).
      print_table: print a table (rich) as well as returning it.
    Returns:
      {"O"|"D"|"P"|"dP"|"dS"|"dQ"|"dK"|"dV": {"cos_sim", "rel_l1", "rel_l2", "rmse"}}.
    """
    _checks.check_choice("method", method, METHODS)
    shape = _checks.check_qkv(q, k, v)
    if not hasattr(do, "shape") or not hasattr(do, "dtype"):
        raise TypeError(f"do must be a jax or numpy array, got {type(do).__name__}")
    if tuple(do.shape) != tuple(q.shape):
        raise ValueError(f"do must have q's shape {tuple(q.shape)}, got {tuple(do.shape)}")
    if np.dtype(do.dtype) != np.dtype(q.dtype):
        raise TypeError(f"do must have q's dtype {np.dtype(q.dtype).name}, got {np.dtype(do.dtype).name}")
    causal = bool(options.get("causal", False))
    scale = _checks.check_scale(options.get("scale"), shape.head_dim)
    exact = _exact_intermediates(q, k, v, do, causal=causal, scale=scale)

    fn = sage_attention if method == "sage" else qat_attention
    o, vjp = jax.vjp(functools.partial(fn, **options), q, k, v)
    dq, dk, dv = vjp(do)
    # Intermediates from the reference with the same quantization.
    ref_opts = {**options, "implementation": "xla", "interpret": False}
    inter = _sage_intermediates(q, k, v, do, ref_opts) if method == "sage" else _qat_intermediates(
        q, k, v, do, ref_opts)
    ours = {"O": o, "D": inter["D"], "P": inter["P"], "dP": inter["dP"], "dS": inter["dS"], "dQ": dq, "dK": dk,
            "dV": dv}
    report = {name: error_metrics(ours[name], exact[name]) for name in ORDER}
    if print_table:
        _print(report, title=f"{method} vs exact fp32, q {tuple(q.shape)} k {tuple(k.shape)} {np.dtype(q.dtype).name}")
    return report


def _sage_intermediates(q, k, v, do, ref_opts: dict) -> dict:
    ref_opts.pop("backward", None)
    opts = resolve_options(q, k, v, **ref_opts)
    o_ref, lse, ops = _forward(q, k, v, None, opts=opts, transposed=False)
    bias = smoothing_bias(ops, scale=opts.scale) if opts.smooth_q else None
    _, inter = sage_backward_reference(ops, bias, o_ref, lse, do, sq_len=opts.seq_q, sk_len=opts.seq_k,
                                       causal=opts.causal, per_block=opts.per_block, scale=opts.scale,
                                       config=opts.config, intermediates=True)
    return inter


def _qat_intermediates(q, k, v, do, ref_opts: dict) -> dict:
    opts = resolve_qat_options(q, k, v, **ref_opts)
    if opts.smooth_k:
        k = smoothing.subtract_token_mean(k)
    o, o_aux, lse, m, (qf, kf, vf) = qat_forward(q, k, v, opts=opts, with_aux=True)
    kf, vf = kv_in_key_order(kf, vf, kv_lane_order(opts, q.shape[-1], q.dtype))  # the reference takes keys in order
    _, inter = qat_backward_reference(qf, kf, vf, o if opts.naive_backward else o_aux, lse, m, do,
                                      sq_len=opts.seq_q, sk_len=opts.seq_k, causal=opts.causal, scale=opts.scale,
                                      config=opts.config, naive=opts.naive_backward, intermediates=True)
    return inter


def _print(report: dict[str, dict[str, float]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("tensor", "cos-sim", "rel-L2", "rel-L1", title=title)
    for name, m in report.items():
        table.add_row(name, f"{m['cos_sim']:.5f}", f"{m['rel_l2']:.4f}", f"{m['rel_l1']:.4f}")
    Console().print(table)
