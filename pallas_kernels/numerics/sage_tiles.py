"""SageAttention's quantization recipe on one tile, shared by kernel and reference.

The fused quantize kernel calls these on a (rows, D) tile it loaded; the pure-JAX
reference calls them on every tile at once, with extra leading dims. Same
function, same numbers (up to the hardware's exp2).

Layouts produced (head-major, padded to whole tiles; see :class:`SageOperands`):

* Q̂ (B, Hq, Sq_pad, D) int8, per-token or per-block scale (B, Hq, Sq_pad) f32
  that already includes ``softmax_scale · log2(e)``;
* K̂ (B, Hkv, Sk_pad, D) int8 after K-smoothing, scale (B, Hkv, Sk_pad) f32
  (per-block scales are stored repeated per token);
* V̂ᵀ (B, Hkv, D, Sk_pad) int8 — transposed so P·V contracts over contiguous
  memory — with a per-channel scale (B, Hkv, D) over all tokens, applied once
  to the output instead of per tile.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.numerics import e4m3, int8
from pallas_kernels.numerics.smoothing import masked_tile_mean


class SageOperands(NamedTuple):
    """Quantized operands of the INT8 attention (what the backward keeps too).

    Attributes:
      q: int8 (B, Hq, Sq_pad, D).
      q_scale: float32 (B, Hq, Sq_pad), includes ``scale · log2(e)``.
      k: int8 (B, Hkv, Sk_pad, D), K-smoothed if smoothing is on.
      k_scale: float32 (B, Hkv, Sk_pad).
      vt: int8 (B, Hkv, D, Sk_pad), V̂ transposed.
      v_scale: float32 (B, Hkv, D), per channel.
      q_mean: float32 (B, Hq, Sq_pad // block_q, D) block means removed by
        Q-smoothing, or None.
      q_t: int8 (B, Hq, D, Sq_pad) Q̂ᵀ for the backward (dK = dSᵀQ), or None.
      k_t: int8 (B, Hkv, D, Sk_pad) K̂ᵀ for the backward (dQ = dS·K), or None.
    """

    q: jax.Array
    q_scale: jax.Array
    k: jax.Array
    k_scale: jax.Array
    vt: jax.Array
    v_scale: jax.Array
    q_mean: jax.Array | None = None
    q_t: jax.Array | None = None
    k_t: jax.Array | None = None


def quantize_qk_tile(
    x: jax.Array | tuple[jax.Array, ...],
    valid: jax.Array,
    mean: jax.Array | tuple[jax.Array, ...] | None,
    *,
    per_block: bool,
    smooth_block: bool,
    out_scale: float,
) -> tuple:
    """Smooth and INT8-quantize a tile of Q or K rows.

    Args:
      x: (..., rows, D) any float dtype: the tile as loaded (invalid rows any value); or a tuple of its
        column parts (..., rows, D_i) (the channel halves a kernel loads apart, :mod:`qk_prologue`).
      valid: bool (..., rows, 1): rows inside the sequence.
      mean: float32 (..., 1, D) channel mean to subtract (K-smoothing), or None; a tuple of parts with x's.
      per_block: one scale for the tile instead of one per row.
      smooth_block: subtract the tile's own mean over valid rows (Q-smoothing).
      out_scale: constant folded into the returned scale (``scale·log2 e`` for Q).
    Returns:
      ``(codes, scale, block_mean)``: int8 (..., rows, D) with invalid rows zero;
      float32 (..., rows) scale times ``out_scale``; the removed tile mean
      float32 (..., 1, D) when ``smooth_block`` else None. Codes and mean are tuples of parts when x is.
    """
    parts = isinstance(x, tuple)
    xs = x if parts else (x,)
    means = (mean if parts else (mean,)) if mean is not None else (None,) * len(xs)
    xfs, bmeans = [], []
    for xp, mp in zip(xs, means):
        xf = xp.astype(jnp.float32)
        if mp is not None:
            xf = xf - mp
        if smooth_block:
            bmeans.append(masked_tile_mean(xf, valid))
            xf = xf - bmeans[-1]
        xfs.append(jnp.where(valid, xf, 0.0))
    amax = jnp.max(int8.magnitude(xfs[0]), axis=-1)  # (..., rows); +inf for a row holding NaN or inf
    for xf in xfs[1:]:
        amax = jnp.maximum(amax, jnp.max(int8.magnitude(xf), axis=-1))
    if per_block:
        amax = jnp.broadcast_to(jnp.max(amax, axis=-1, keepdims=True), amax.shape)
    scale = int8.scale_from_amax(amax)
    codes = tuple(int8.encode_with_scale(xf, scale[..., None]) for xf in xfs)
    bmean = (tuple(bmeans) if parts else bmeans[0]) if smooth_block else None
    return (codes if parts else codes[0]), scale * out_scale, bmean


#: formats of V̂ and P̂ in the forward's P·V product (``SageFwdConfig.pv_format``)
PV_FORMATS = ("int8", "e4m3")


def quantize_v_tile(v: jax.Array, valid: jax.Array, v_scale: jax.Array, fmt: str = "int8", *,
                    arithmetic: bool = False) -> jax.Array:
    """Codes of a V tile with a given per-channel scale: INT8 (the paper's) or e4m3 (:mod:`.e4m3`).

    Args:
      v: (..., rows, D) any float dtype.
      valid: bool (..., rows, 1).
      v_scale: float32 (..., 1, D), from :func:`v_channel_scale` of the same ``fmt``.
      fmt: one of :data:`PV_FORMATS`.
      arithmetic: e4m3 codes rounded in float arithmetic first (``e4m3.encode_with_scale``: XLA graphs).
    Returns:
      int8 or float8_e4m3fn (..., rows, D), invalid rows zero.
    """
    vf = jnp.where(valid, v.astype(jnp.float32), 0.0)
    if fmt == "e4m3":
        return e4m3.encode_with_scale(vf, v_scale, arithmetic=arithmetic)
    return int8.encode_with_scale(vf, v_scale)


def v_scale_from_amax(amax: jax.Array, fmt: str = "int8") -> jax.Array:
    """V's per-channel scale from its per-channel amax: amax/127 (INT8) or amax/448 (e4m3)."""
    return (e4m3.scale_from_amax if fmt == "e4m3" else int8.scale_from_amax)(amax)


def v_channel_scale(v: jax.Array, fmt: str = "int8") -> jax.Array:
    """Per-channel scale of V over all tokens (:func:`v_scale_from_amax`).

    Args:
      v: (B, Sk, Hkv, D) any float dtype.
      fmt: one of :data:`PV_FORMATS`.
    Returns:
      float32 (B, Hkv, D).
    """
    return v_scale_from_amax(jnp.max(int8.magnitude(v), axis=1), fmt)  # exact in v's dtype


def dequantize_v_t(vt8: jax.Array, v_scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Ṽᵀ = V̂ᵀ·s_V rounded to ``dtype``: SageBwd's 16-bit operand of dP = dO·Ṽᵀ.

    Args:
      vt8: int8 or e4m3 (..., D, S) codes (V̂ transposed); v_scale: float32 (..., D) per channel.
      dtype: dO's dtype.
    Returns:
      (..., D, S) in ``dtype``. The backward kernels call it on a tile, the reference on
      the whole array.
    """
    return int8.dequantize(vt8, v_scale[..., None]).astype(dtype)


def base2_lse(m: jax.Array, l: jax.Array) -> jax.Array:
    """The base-2 log-sum-exp m + log2(l) of softmax rows with row max m and sum l = Σ exp2(S − m),
    and +inf for rows that see no key (l = 0), so that P = exp2(S − L) is 0 there. The one
    convention every forward (Sage and Attn-QAT, kernels and references) writes and
    :func:`pad_lse` pads with."""
    empty = l == 0.0
    return jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def pad_lse(lse: jax.Array, sq_pad: int) -> jax.Array:
    """(B, Hq, Sq) base-2 LSE → (B, Hq, Sq_pad), padded with +inf (padded rows get P = 0).

    The backward kernels and the reference both read P = exp2(S − L) on padded tiles.
    """
    return jnp.pad(lse, ((0, 0), (0, 0), (0, sq_pad - lse.shape[2])), constant_values=jnp.inf)
