"""Smoothing: subtract a channel mean before quantizing (docs/spec.md).

K-smoothing subtracts the mean over tokens of K (per batch, kv-head, channel).
Every score row then shifts by the constant ``q · k̄``, so the softmax is
unchanged; a returned log-sum-exp has to add that shift back.
Q-smoothing subtracts the mean of each query block; the removed part
``q̄_block · Kᵀ`` is added back to the scores in fp32.

Written with Triton-safe ops only: the tile functions run inside kernels too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_mean(x: jax.Array, axis: int = 1) -> jax.Array:
    """Mean over tokens in float32.

    Args:
      x: (B, S, H, D), any float dtype.
      axis: the token axis.
    Returns:
      float32, x's shape without ``axis`` ((B, H, D) for the default layout).
    """
    return jnp.mean(x.astype(jnp.float32), axis=axis)


def subtract_token_mean(k: jax.Array) -> jax.Array:
    """K-smoothing on a whole (B, S, H, D) array, in k's dtype (differentiable; the mean is removed from
    the gradient too, which attention's gradient w.r.t. k never has)."""
    kf = k.astype(jnp.float32)
    return (kf - jnp.mean(kf, axis=1, keepdims=True)).astype(k.dtype)


def masked_tile_mean(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Mean over the rows of a tile that are ``valid`` (at least one row counted).

    Args:
      x: float32 (..., rows, D).
      valid: bool (..., rows, 1).
    Returns:
      float32 (..., 1, D).
    """
    total = jnp.sum(jnp.where(valid, x, 0.0), axis=-2, keepdims=True)
    count = jnp.maximum(jnp.sum(valid.astype(jnp.float32), axis=-2, keepdims=True), 1.0)
    return total / count
