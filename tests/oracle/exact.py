"""Exact softmax attention and its gradient in float64 numpy, written from docs/spec.md.

Masked (invisible) query-key pairs take no part at all: their score, probability and every product with them
is left out, not multiplied by zero. That is how flash attention behaves, and it decides where non-finite
input shows: a NaN in query row i reaches key j's gradient only if row i sees key j.
"""

from __future__ import annotations

import numpy as np


def visible(sq: int, sk: int, causal: bool) -> np.ndarray:
    """bool (Sq, Sk): query i sees key j; causal is bottom-right aligned (j <= i + Sk - Sq)."""
    rows, cols = np.arange(sq)[:, None], np.arange(sk)[None, :]
    return (cols <= rows + (sk - sq)) if causal else np.ones((sq, sk), bool)


def _heads(q, k, v):
    """float64 (B, H, S, D) views, k and v repeated over their query-head groups."""
    group = q.shape[2] // k.shape[2]
    to = lambda x, rep: np.repeat(np.moveaxis(np.asarray(x, np.float64), 2, 1), rep, axis=1)  # noqa: E731
    return to(q, 1), to(k, group), to(v, group)


def _probabilities(q, k, causal, scale):
    """(P (B, H, Sq, Sk), mask (Sq, Sk)): softmax over the visible keys; masked entries exactly 0; rows that see
    no key all 0."""
    mask = visible(q.shape[2], k.shape[2], causal)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
        s = np.where(mask, s, -np.inf)
        m = np.max(s, axis=-1, keepdims=True)
        m = np.where(np.isneginf(m), 0.0, m)
        e = np.where(mask, np.exp(s - m), 0.0)
        l = e.sum(axis=-1, keepdims=True)
        p = np.where(mask, e / np.where(l == 0.0, 1.0, l), 0.0)
    return p, mask


def attention(q, k, v, *, causal: bool = False, scale: float | None = None) -> np.ndarray:
    """o (B, Sq, Hq, D) float64 for q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh, kh, vh = _heads(q, k, v)
    p, mask = _probabilities(qh, kh, causal, scale)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        o = np.where(mask[..., None], p[..., None] * vh[:, :, None, :, :], 0.0).sum(axis=3)
    return np.moveaxis(o, 1, 2)


def attention_grads(q, k, v, do, *, causal: bool = False, scale: float | None = None):
    """(dq, dk, dv) float64 of :func:`attention` for the output cotangent ``do``: dV = Pᵀ dO, dP = dO Vᵀ,
    D = rowsum(dO ∘ O), dS = P ∘ (dP − D), dQ = dS K · scale, dK = dSᵀ Q · scale, each sum over visible pairs
    only; dk and dv summed over each kv head's query heads."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh, kh, vh = _heads(q, k, v)
    doh = np.moveaxis(np.asarray(do, np.float64), 2, 1)
    p, mask = _probabilities(qh, kh, causal, scale)
    pairs = mask[..., None]  # (Sq, Sk, 1)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        o = np.where(pairs, p[..., None] * vh[:, :, None], 0.0).sum(axis=3)
        dv = np.where(pairs, p[..., None] * doh[:, :, :, None], 0.0).sum(axis=2)
        dp = np.einsum("bhqd,bhkd->bhqk", doh, vh)
        delta = (doh * o).sum(axis=-1, keepdims=True)
        ds = np.where(mask, p * (dp - delta), 0.0)
        dq = np.where(pairs, ds[..., None] * kh[:, :, None], 0.0).sum(axis=3) * scale
        dk = np.where(pairs, ds[..., None] * qh[:, :, :, None], 0.0).sum(axis=2) * scale
        group = q.shape[2] // k.shape[2]
        fold = lambda x: np.moveaxis(x.reshape(x.shape[0], -1, group, *x.shape[2:]).sum(axis=2), 1, 2)  # noqa: E731
        return np.moveaxis(dq, 1, 2), fold(dk), fold(dv)
