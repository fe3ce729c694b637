"""Attn-QAT's per-row backward inputs and the head-major layout, shared by the kernels and the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def head_major(x: jax.Array, seq_pad: int, dtype=None) -> jax.Array:
    """(B, S, H, D) → (B, H, seq_pad, D), zero rows appended."""
    xt = jnp.swapaxes(x, 1, 2)
    xt = jnp.pad(xt, ((0, 0), (0, 0), (0, seq_pad - x.shape[1]), (0, 0)))
    return xt if dtype is None else xt.astype(dtype)



def backward_rows(o_aux: jax.Array, lse: jax.Array, m: jax.Array, do: jax.Array, *, seq_pad: int, dtype,
                  head_major_do: bool = True):
    """The backward's per-row inputs (memory-bound; XLA fuses it), shared by the kernels and the reference.

    Args:
      o_aux: O' (or O) (B, Sq, Hq, D); lse, m: base-2 LSE and row max (B, Hq, Sq); do: (B, Sq, Hq, D).
    Returns:
      D = rowsum(dO ∘ o_aux), m with −inf → 0, 1/l = exp2(m − L) (0 for empty rows), each float32
      (B, Hq, seq_pad) with zero padding — so P = exp2(S − m)·(1/l) — and dO head-major
      (B, Hq, seq_pad, D) in ``dtype``; with ``head_major_do=False`` dO as it is, (B, seq_pad, Hq, D) (a kernel
      that reads it by rows of one head: no transpose).
    """
    row_pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, seq_pad - x.shape[2])))  # noqa: E731
    delta = jnp.swapaxes(jnp.sum(o_aux.astype(jnp.float32) * do.astype(jnp.float32), axis=-1), 1, 2)
    m_ref = jnp.where(m == -jnp.inf, 0.0, m)
    inv_l = jnp.where(lse == jnp.inf, 0.0, jnp.exp2(m_ref - lse))
    do_out = head_major(do, seq_pad, dtype) if head_major_do else jnp.pad(
        do, ((0, 0), (0, seq_pad - do.shape[1]), (0, 0), (0, 0))).astype(dtype)
    return row_pad(delta), row_pad(m_ref), row_pad(inv_l), do_out
