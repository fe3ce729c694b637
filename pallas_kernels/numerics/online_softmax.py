"""The base-2 online-softmax step that the 16-bit/FP4 flash kernels and their pure-JAX twins share.

Backend-neutral ``jax.numpy`` (it runs on Triton tiles, in the interpreter and on whole arrays alike).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def online_softmax_step(tiles: list[jax.Array], m_prev: jax.Array, l_prev: jax.Array, *,
                        masked: bool = True) -> tuple[list[jax.Array], jax.Array, jax.Array, jax.Array]:
    """One step over a row block's new scores, given as one or several tiles of the same rows.

    Args:
      tiles: base-2 scores (..., rows, keys) each (−inf where masked); several tiles are one step's keys in parts.
      m_prev, l_prev: the running row max and row sum (..., rows) float32.
      masked: the scores may hold −inf (then a row whose max is still −inf takes 0 as its reference, so
        exp2 gives zeros, not NaN); False skips that guard for tiles every row sees whole.
    Returns:
      (the tiles' P = exp2(s − m_new), α = exp2(m_prev − m_new) to rescale the accumulators, m_new, l_new).
    """
    m_new = m_prev
    for s in tiles:
        m_new = jnp.maximum(m_new, jnp.max(s, axis=-1))
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    ps = [jnp.exp2(s - m_ref[..., None]) for s in tiles]
    alpha = jnp.exp2(m_prev - m_ref)
    l_new = l_prev * alpha
    for p in ps:
        l_new = l_new + jnp.sum(p, axis=-1)
    return ps, alpha, m_new, l_new
