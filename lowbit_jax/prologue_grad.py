"""The QK prologue's share of an attention's custom_vjp: its inputs kept, and the cotangents it returns.

:func:`lowbit_jax.sage_attention` and :func:`lowbit_jax.qat_attention` take the pre-norm q and k with a
:class:`lowbit_jax.QKPrologue` and apply the norm and rotation inside the kernels that read q and k. Their
backward gets the gradient of the normalized, rotated q and k from the attention's own backward; this module turns
it into the gradients of the pre-norm q, k and of the prologue's fields (the norm scales; zeros for the tables).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.numerics import qk_prologue
from pallas_kernels.numerics.qk_prologue import QKPrologue
from pallas_kernels import qk_prologue as prologue_kernels


def residuals(q: jax.Array, k: jax.Array, prologue: QKPrologue | None) -> tuple | None:
    """What the backward of a prologue needs from the forward: the pre-norm q and k and the prologue (None
    without one)."""
    return None if prologue is None else (q, k, prologue)


def prologue_backward(x: jax.Array, dz: jax.Array, prologue: QKPrologue, which: str, *, pallas: bool,
                      interpret: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """Gradient of ``which`` side ("q" or "k") of the prologue.

    Args:
      x: (B, S, H, D) the pre-norm input; dz: (B, S, H, D) the gradient of its normalized, rotated value.
      pallas: run the Triton pass (:mod:`pallas_kernels.qk_prologue`; interpreted with ``interpret``), else the
        reference (``qk_prologue.apply_backward``).
    Returns:
      dx in x's dtype and the norm scale's float32 gradient (D,) (or None without a norm).
    """
    g, cos, sin = prologue.side(which)
    if pallas:
        return prologue_kernels.qk_prologue_bwd(x, dz, g, cos, sin, eps=prologue.eps, interpret=interpret)
    return qk_prologue.apply_backward(x, dz, g, cos, sin, eps=prologue.eps)


def cotangents(pre: tuple | None, dq: jax.Array, dk: jax.Array, *, pallas: bool,
               interpret: bool = False) -> tuple[jax.Array, jax.Array, QKPrologue | None]:
    """``(dq, dk, d_prologue)`` for the gradients ``dq``, ``dk`` of the normalized, rotated q and k.

    ``pre``: :func:`residuals`' value. Without a prologue dq and dk are returned as they are, with None. With one,
    the pre-norm q's and k's gradients and a :class:`QKPrologue` of cotangents: the norm scales' gradients in
    their dtypes, zeros for the RoPE tables (positions are not trained).
    """
    if pre is None:
        return dq, dk, None
    q, k, prologue = pre
    (dq, dgq), (dk, dgk) = (prologue_backward(x, dx, prologue, which, pallas=pallas, interpret=interpret)
                            for x, dx, which in ((q, dq, "q"), (k, dk, "k")))
    zeros = lambda t: None if t is None else jnp.zeros_like(t)  # noqa: E731
    dpro = QKPrologue(
        None if dgq is None else dgq.astype(prologue.q_norm.dtype),
        None if dgk is None else dgk.astype(prologue.k_norm.dtype),
        zeros(prologue.cos_q), zeros(prologue.sin_q), zeros(prologue.cos_k), zeros(prologue.sin_k),
        eps=prologue.eps)
    return dq, dk, dpro
