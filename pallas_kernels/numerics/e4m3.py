"""FP8 e4m3 operands of SageAttention's P·V product (``SageFwdConfig.pv_format="e4m3"``), shared by the kernels and
the reference.

SageAttention2's Hopper recipe: Q̂K̂ᵀ stays INT8, P·V runs on FP8 tensor cores. V is scaled per channel over all
tokens so its largest magnitude maps to e4m3's largest finite value 448, then rounded to nearest even; P̃ is taken
at the running row max (so P̃ ≤ 1) and stored as P̃·448, rounded likewise. e4m3 keeps a relative precision of three
mantissa bits at every magnitude, so the many small P̃ of a long, diffuse row keep theirs (INT8 at the running max
would round them to a few codes). Each key tile's product is summed in float32 and added to O in float32 (Hopper's
FP8 ``wgmma`` accumulates with fewer bits than float32: O carried in it across tiles loses a channel's offset).

A NaN stays NaN; finite values stay within ±448 by construction (their scales), so no conversion overflows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.numerics.nvfp4 import e4m3_round

#: e4m3's largest finite value: the code of a channel's amax and of P̃ = 1
MAX = 448.0
#: log2(MAX): P̃·448 = exp2(S − m + LOG2_MAX), the factor folded into the exponent
LOG2_MAX = math.log2(MAX)
DTYPE = jnp.float8_e4m3fn


def scale_from_amax(amax: jax.Array) -> jax.Array:
    """Dequantization scale ``amax / 448``, ``amax == 0`` mapped to 1, a non-finite amax kept non-finite.

    Args:
      amax: float32, non-negative or NaN/+inf.
    Returns:
      float32 of amax's shape.
    """
    amax = amax.astype(jnp.float32)
    return jnp.where(amax == 0.0, 1.0, amax * (1.0 / MAX))


def rounded(x: jax.Array) -> jax.Array:
    """float32 ``x`` rounded to e4m3fn's grid (nearest, ties to even; NaN and ±inf give NaN) by float arithmetic,
    as float32: the values of ``x.astype(DTYPE).astype(float32)`` for |x| < 464 (beyond, ±448 instead of NaN;
    the codes here stay within ±448 by their scales).

    For XLA graphs (the references): XLA on the GPU removes a float32 → float8 → float32 round trip as excess
    precision (``xla_allow_excess_precision``), which left the e4m3 reference unrounded there, 2.5% off the
    kernels in O. Kernels convert in hardware instead.
    """
    x = x.astype(jnp.float32)
    magnitude = e4m3_round(jnp.abs(x))
    return jnp.where(x < 0, -magnitude, magnitude)


def encode_with_scale(x: jax.Array, scale: jax.Array, *, arithmetic: bool = False) -> jax.Array:
    """e4m3 codes of ``x · (1/scale)`` (the reciprocal per group, one multiply per element, as the INT8 ψ), rounded
    to nearest even; ``scale`` from :func:`scale_from_amax` of x's group keeps them within ±448.

    Args:
      x: float array; scale: float32 broadcastable to x, positive.
      arithmetic: round by :func:`rounded` first (XLA graphs; the cast is then exact), not by the cast (kernels).
    Returns:
      float8_e4m3fn array of x's shape.
    """
    y = x.astype(jnp.float32) * (1.0 / scale)
    return (rounded(y) if arithmetic else y).astype(DTYPE)


def encode_probabilities(e: jax.Array) -> jax.Array:
    """e4m3 codes of P̃·448 given as float32 in [0, 448] (the kernels fold the 448 into the exponent); an XLA graph
    takes their values as :func:`rounded` instead."""
    return e.astype(DTYPE)


__all__ = ["DTYPE", "LOG2_MAX", "MAX", "encode_probabilities", "encode_with_scale", "rounded", "scale_from_amax"]
