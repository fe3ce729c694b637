"""QK-norm and RoPE as the prologue of SageAttention's quantization passes, shared by kernel and reference.

A transformer's attention computes ``q = rope(rms_norm(q_proj(x)))`` (and so for k) just before attention.
Unfused, those are two extra passes over q and k in memory (the norm's row reduction, then the normalized and
rotated copy), and their backward three more (the norm's gradient, its scale's gradient, the rotated gradient).
SageAttention reads q and k anyway to quantize them, so :func:`lowbit_jax.sage_attention` can take the
pre-norm q and k with a :class:`QKPrologue` and apply the norm and the rotation in its quantization kernels.

Semantics (what a Flax model's ``nnx.RMSNorm`` then rotate-half RoPE compute, roundings included): per row of
D channels, in float32,

* ``y = round(x · (rsqrt(mean(x²) + eps) · g))`` with ``g`` the norm's scale (in the model's dtype),
* ``z = round((y₁·cos − y₂·sin, y₂·cos + y₁·sin))`` with y₁, y₂ the two halves of y (rotate-half form) and
  cos, sin the row's position tables (D/2 each),

``round`` rounding to q's dtype, as the model's 16-bit activations are; z is what the quantizers see. Either
step may be absent (no norm: y = x; no RoPE: z = y). The backward mirrors autodiff of that composition,
rounding the rotated-back gradient to q's dtype as the cotangent of a 16-bit y is.

The tile functions take the two channel halves separately (``(rows, D/2)`` each): Pallas' Triton lowering
cannot slice a loaded tile, so the kernels load the halves from their refs; the reference splits arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
Rounding = Callable[[jax.Array], jax.Array]

_MANTISSA_BITS = {jnp.dtype(jnp.bfloat16): (8, 7), jnp.dtype(jnp.float16): (5, 10)}


def exact_rounding(dtype) -> Rounding:
    """float32 → ``dtype`` → float32 as ``lax.reduce_precision`` (XLA keeps it; a convert pair it may drop
    where excess precision is allowed). For the references; identity for float32. reduce_precision flushes
    fp16's subnormals, so those (|v| < 2⁻¹⁴) are rounded on their own grid of 2⁻²⁴ (half to even, as a convert)."""
    bits = _MANTISSA_BITS.get(jnp.dtype(dtype))
    if bits is None:
        return lambda v: v
    normal = lambda v: lax.reduce_precision(v, exponent_bits=bits[0], mantissa_bits=bits[1])  # noqa: E731
    if jnp.dtype(dtype) != jnp.dtype(jnp.float16):
        return normal
    return lambda v: jnp.where(jnp.abs(v) < 2.0**-14, jnp.round(v * 2.0**24) * 2.0**-24, normal(v))


def convert_rounding(dtype) -> Rounding:
    """float32 → ``dtype`` → float32 as two converts (what the Triton kernels can lower; compiled, the round
    trip is kept)."""
    if jnp.dtype(dtype) == jnp.dtype(F32):
        return lambda v: v
    return lambda v: v.astype(dtype).astype(F32)


def kernel_rounding(dtype, interpret: bool) -> Rounding:
    """A kernel's rounding: :func:`convert_rounding` compiled, :func:`exact_rounding` interpreted (XLA may drop
    the convert pair there, which the compiled kernel keeps)."""
    return (exact_rounding if interpret else convert_rounding)(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QKPrologue:
    """QK-norm and RoPE applied to q and k inside :func:`lowbit_jax.sage_attention` (see the module docstring).

    Attributes:
      q_norm, k_norm: (D,) RMSNorm scales of q and of k (in q's dtype, as the model promotes them), or None
        for no norm (both or neither).
      cos_q, sin_q: float32 (Sq, D/2) RoPE tables of the query positions, or None for no RoPE.
      cos_k, sin_k: float32 (Sk, D/2) of the key positions (None with cos_q).
      eps: the norm's epsilon (static).
    """

    q_norm: jax.Array | None
    k_norm: jax.Array | None
    cos_q: jax.Array | None
    sin_q: jax.Array | None
    cos_k: jax.Array | None
    sin_k: jax.Array | None
    eps: float = dataclasses.field(default=1e-6, metadata=dict(static=True))

    @property
    def has_norm(self) -> bool:
        return self.q_norm is not None

    @property
    def has_rope(self) -> bool:
        return self.cos_q is not None

    def side(self, which: str) -> tuple:
        """``(g, cos, sin)`` of ``which`` ("q" or "k")."""
        return (self.q_norm, self.cos_q, self.sin_q) if which == "q" else (self.k_norm, self.cos_k, self.sin_k)


def rope_tables(positions: jax.Array, head_dim: int, base: float = 10000.0,
                freq_factors: Sequence[float] | jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotate-half RoPE angles ``position · base^(−2i/D) / factor_i``.

    Args:
      positions: int or float (S,) or (B, S).
      head_dim: D (even).
      freq_factors: None (all 1) or D/2 divisors of the inverse frequencies (Llama-3 rope scaling, llama.cpp's
        ``rope_freqs``).
    Returns:
      float32 (..., S, D/2) cos and sin.
    """
    inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=F32) / head_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / jnp.asarray(freq_factors, F32)
    angles = positions.astype(F32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x1: jax.Array, x2: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rotate-half RoPE of the halves (float32)."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def _row_rsqrt(x1, x2, eps):
    d = 2 * x1.shape[-1]
    ms = (jnp.sum(x1 * x1, axis=-1, keepdims=True) + jnp.sum(x2 * x2, axis=-1, keepdims=True)) / d
    return lax.rsqrt(ms + eps)


def forward_halves(x1: jax.Array, x2: jax.Array, g1: jax.Array | None, g2: jax.Array | None,
                   cos: jax.Array | None, sin: jax.Array | None, *, eps: float,
                   rounding: Rounding) -> tuple[jax.Array, jax.Array]:
    """The prologue of a tile: (z₁, z₂) from the channel halves of x.

    Args:
      x1, x2: (..., rows, D/2) any float dtype.
      g1, g2: (..., 1, D/2) the norm scale's halves, or None (no norm).
      cos, sin: float32 (..., rows, D/2), or None (no RoPE).
      eps: the norm's epsilon.
      rounding: float32 → q's dtype → float32 (:func:`exact_rounding` or :func:`convert_rounding`).
    Returns:
      float32 (..., rows, D/2) twice, each value representable in q's dtype.
    """
    y1, y2 = x1.astype(F32), x2.astype(F32)
    if g1 is not None:
        r = _row_rsqrt(y1, y2, eps)
        y1, y2 = rounding(y1 * (r * g1.astype(F32))), rounding(y2 * (r * g2.astype(F32)))
    if cos is not None:
        z1, z2 = rotate(y1, y2, cos, sin)
        y1, y2 = rounding(z1), rounding(z2)
    return y1, y2


def backward_halves(x1: jax.Array, x2: jax.Array, dz1: jax.Array, dz2: jax.Array, g1: jax.Array | None,
                    g2: jax.Array | None, cos: jax.Array | None, sin: jax.Array | None, *, eps: float,
                    rounding: Rounding) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """Gradients of :func:`forward_halves` at x for the cotangent dz (float32 math).

    Args:
      x1, x2: (..., rows, D/2) the pre-norm input's halves.
      dz1, dz2: (..., rows, D/2) the cotangent of z's halves (any float dtype).
      g1, g2, cos, sin, eps: as :func:`forward_halves`.
      rounding: applied to the rotated-back gradient when there is a norm (the cotangent of the 16-bit y).
    Returns:
      ``(dx1, dx2, dg1, dg2)``: float32 (..., rows, D/2) gradients of x, and each row's contribution to the
      norm scale's gradient (sum them over rows; None without a norm).
    """
    dy1, dy2 = dz1.astype(F32), dz2.astype(F32)
    if cos is not None:  # the transpose of the rotation
        dy1, dy2 = dy1 * cos + dy2 * sin, dy2 * cos - dy1 * sin
    if g1 is None:
        return dy1, dy2, None, None
    dy1, dy2 = rounding(dy1), rounding(dy2)
    xf1, xf2 = x1.astype(F32), x2.astype(F32)
    r = _row_rsqrt(xf1, xf2, eps)
    t1, t2 = dy1 * g1.astype(F32), dy2 * g2.astype(F32)
    d = 2 * x1.shape[-1]
    proj = (jnp.sum(xf1 * t1, axis=-1, keepdims=True) + jnp.sum(xf2 * t2, axis=-1, keepdims=True)) * (r * r * r / d)
    return r * t1 - xf1 * proj, r * t2 - xf2 * proj, xf1 * r * dy1, xf2 * r * dy2


def _halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    h = x.shape[-1] // 2
    return x[..., :h], x[..., h:]


def _side_operands(g, cos, sin):
    """(B, S, H, D)-broadcastable halves of g and the tables."""
    g1 = g2 = None
    if g is not None:
        g1, g2 = _halves(g.reshape(1, 1, 1, -1))
    if cos is not None:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return g1, g2, cos, sin


def apply(x: jax.Array, g: jax.Array | None, cos: jax.Array | None, sin: jax.Array | None, *,
          eps: float) -> jax.Array:
    """The prologue of a whole array (the reference): ``rope(rms_norm(x))`` in x's dtype.

    Args:
      x: (B, S, H, D) bf16/fp16/fp32.
      g: (D,) norm scale or None; cos, sin: float32 (S, D/2) or None.
    Returns:
      (B, S, H, D) in x's dtype.
    """
    g1, g2, c, s = _side_operands(g, cos, sin)
    z1, z2 = forward_halves(*_halves(x), g1, g2, c, s, eps=eps, rounding=exact_rounding(x.dtype))
    return jnp.concatenate([z1, z2], axis=-1).astype(x.dtype)


def apply_qk(q: jax.Array, k: jax.Array, prologue: QKPrologue | None) -> tuple[jax.Array, jax.Array]:
    """:func:`apply` of ``prologue``'s q side to q and its k side to k (both unchanged without a prologue): the
    normalized, rotated q (B, Sq, Hq, D) and k (B, Sk, Hkv, D) in their dtypes, what an attention without the
    fused prologue is given."""
    if prologue is None:
        return q, k
    return (apply(q, *prologue.side("q"), eps=prologue.eps), apply(k, *prologue.side("k"), eps=prologue.eps))


def apply_backward(x: jax.Array, dz: jax.Array, g: jax.Array | None, cos: jax.Array | None,
                   sin: jax.Array | None, *, eps: float) -> tuple[jax.Array, jax.Array | None]:
    """:func:`backward_halves` on whole arrays (the reference of the backward kernel).

    Args:
      x: (B, S, H, D) the pre-norm input; dz: (B, S, H, D) z's cotangent.
      g, cos, sin, eps: as :func:`apply`.
    Returns:
      dx (B, S, H, D) in x's dtype and the norm scale's gradient float32 (D,) or None.
    """
    g1, g2, c, s = _side_operands(g, cos, sin)
    dx1, dx2, dg1, dg2 = backward_halves(*_halves(x), *_halves(dz), g1, g2, c, s, eps=eps,
                                         rounding=exact_rounding(x.dtype))
    dg = None if dg1 is None else jnp.concatenate([jnp.sum(dg1, axis=(0, 1, 2)), jnp.sum(dg2, axis=(0, 1, 2))])
    return jnp.concatenate([dx1, dx2], axis=-1).astype(x.dtype), dg
