"""Exact attention and the accuracy metrics every test and benchmark uses.

``reference_attention`` is plain softmax attention in float32 (or float64 when
x64 is enabled), with the same layout, GQA and bottom-right causal convention as
the library's methods. The metrics use the names of docs/spec.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowbit_jax import _checks


def causal_mask(seq_q: int, seq_k: int) -> jax.Array:
    """bool (Sq, Sk): query i sees key j iff ``j <= i + Sk - Sq`` (bottom-right)."""
    rows = jnp.arange(seq_q)[:, None]
    cols = jnp.arange(seq_k)[None, :]
    return cols <= rows + (seq_k - seq_q)


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
    """Exact softmax attention.

    Args:
      q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D) with Hq a multiple of Hkv.
      causal: bottom-right aligned mask (for Sq = Sk the usual lower triangle).
      scale: softmax scale, default D**-0.5.
      dtype: float32, or float64 where x64 is enabled.
    Returns:
      (B, Sq, Hq, D) in ``dtype``; rows that see no key are zeros.
    """
    shape = _checks.check_qkv(q, k, v)
    scale = _checks.check_scale(scale, shape.head_dim)
    group = shape.heads_q // shape.heads_kv
    qf = q.astype(dtype)
    kf = jnp.repeat(k.astype(dtype), group, axis=2)
    vf = jnp.repeat(v.astype(dtype), group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", qf, kf, precision=jax.lax.Precision.HIGHEST) * scale
    if causal:
        mask = causal_mask(shape.seq_q, shape.seq_k)
        s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(m == -jnp.inf, 0.0, m)  # rows that see no key; a NaN or +inf row max stays (and shows)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l == 0.0, 1.0, l)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vf, precision=jax.lax.Precision.HIGHEST)


def _flat(x: jax.Array, ref: jax.Array) -> tuple[jax.Array, jax.Array]:
    dt = jnp.promote_types(ref.dtype, jnp.float32)
    return x.astype(dt).ravel(), ref.astype(dt).ravel()


def cos_sim(x: jax.Array, ref: jax.Array) -> jax.Array:
    """Cosine similarity of the flattened arrays."""
    a, b = _flat(x, ref)
    return jnp.sum(a * b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))


def rel_l1(x: jax.Array, ref: jax.Array) -> jax.Array:
    """Σ|x − ref| / Σ|ref|."""
    a, b = _flat(x, ref)
    return jnp.sum(jnp.abs(a - b)) / jnp.sum(jnp.abs(b))


def rel_l2(x: jax.Array, ref: jax.Array) -> jax.Array:
    """‖x − ref‖ / ‖ref‖."""
    a, b = _flat(x, ref)
    return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)


def rmse(x: jax.Array, ref: jax.Array) -> jax.Array:
    """Root mean squared error."""
    a, b = _flat(x, ref)
    return jnp.sqrt(jnp.mean((a - b) ** 2))


def error_metrics(x: jax.Array, ref: jax.Array) -> dict[str, float]:
    """All four metrics as Python floats."""
    return {
        "cos_sim": float(cos_sim(x, ref)),
        "rel_l1": float(rel_l1(x, ref)),
        "rel_l2": float(rel_l2(x, ref)),
        "rmse": float(rmse(x, ref)),
    }
