"""The quantized methods in float64 numpy, written from docs/spec.md: SageAttention's INT8 forward, Attn-QAT's
NVFP4 forward, ThriftAttention with every block in NVFP4 (budget 0). ``ml_dtypes`` does the e4m3, e2m1 and bf16
roundings (it rounds to nearest even, exactly); nothing here comes from the package.

Float64 scores differ from the library's float32 ones by about 1e-7, which flips an occasional INT8 or FP4 code
that lies at a rounding midpoint: the tests compare with tolerances set from the measured differences.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from oracle.exact import visible

LOG2E = math.log2(math.e)


def _heads(q, k, v):
    group = q.shape[2] // k.shape[2]
    to = lambda x, rep: np.repeat(np.moveaxis(np.asarray(x, np.float64), 2, 1), rep, axis=1)  # noqa: E731
    return to(q, 1), to(k, group), to(v, group)


# ----------------------------------------------------------------------------- quantizers


def f32(x) -> np.ndarray:
    """Rounded to float32 (kept float64)."""
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def int8_codes(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """round half away from zero of x · (1/scale), the reciprocal and the product in float32, clipped to ±127."""
    y = f32(x * f32(1.0 / scale))
    return np.clip(np.sign(y) * np.floor(np.abs(y) + 0.5), -127, 127)


def int8_scale(amax: np.ndarray) -> np.ndarray:
    """amax / 127 as float32 amax · fl32(1/127); 1 for an all-zero group."""
    return np.where(amax == 0, 1.0, f32(f32(amax) * f32(1.0 / 127.0)))


def e4m3(x: np.ndarray) -> np.ndarray:
    """Round to e4m3fn with sign, saturating at ±448."""
    return np.clip(x, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def e2m1(x: np.ndarray) -> np.ndarray:
    """Round to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} with sign, saturating at ±6."""
    return np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)


def bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def fake_quant(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """NVFP4 φ⁻¹(φ(x)) in groups of 16 along ``axis``: sf = e4m3(amax/6) (1 for a zero group),
    e2m1(x · fl32(1/sf))·sf — the scale's float32 reciprocal, multiplied (as NVIDIA's encoders do)."""
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    g = x.reshape(*x.shape[:-1], -1, 16)
    sf = e4m3(np.abs(g).max(axis=-1, keepdims=True) / 6.0)
    sf = np.where(sf == 0, 1.0, sf)
    out = (e2m1(f32(g * f32(1.0 / sf))) * sf).reshape(x.shape)
    return np.moveaxis(out, -1, axis)


def fake_quant_p_bf16(p: np.ndarray) -> np.ndarray:
    """FQ of probabilities for bf16 operands, groups of 16 along the last axis: P rounded to bf16, then the scale's
    reciprocal and the scaled value each rounded to bf16 (the 16-bit arithmetic the kernels use)."""
    h = bf16(p)
    g = h.reshape(*h.shape[:-1], -1, 16)
    sf = e4m3(g.max(axis=-1, keepdims=True) / 6.0)
    sf = np.where(sf == 0, 1.0, sf)
    y = bf16(g * bf16(1.0 / sf))
    return (e2m1(y) * sf).reshape(h.shape)


# ----------------------------------------------------------------------------- SageAttention


def sage_forward(q, k, v, *, causal: bool, block_q: int, block_k: int, per_block: bool = True,
                 smooth_k: bool = True, scale: float | None = None, pv_format: str = "int8") -> np.ndarray:
    """SageAttention's forward (docs/spec.md): o (B, Sq, Hq, D) float64. ``pv_format="e4m3"``: P·V in FP8 e4m3,
    P̃ at the running row max times 448 and V per channel over all tokens scaled so its amax is 448."""
    qh, kh, vh = _heads(q, k, v)
    b, h, sq, d = qh.shape
    sk = kh.shape[2]
    scale = d ** -0.5 if scale is None else scale
    if smooth_k:
        kh = kh - kh.mean(axis=2, keepdims=True)

    def per_rows(x, block):  # (B, H, S, D): a scale per row (per token) or per block of rows
        amax = np.abs(x).max(axis=-1)
        if per_block:
            n = x.shape[2]
            pad = -(-n // block) * block
            a = np.pad(amax, ((0, 0), (0, 0), (0, pad - n))).reshape(b, h, -1, block).max(axis=-1)
            amax = np.repeat(a, block, axis=-1)[..., :n]
        s = int8_scale(amax)[..., None]
        return int8_codes(x, s), s

    q8, sq_scale = per_rows(qh, block_q)
    k8, sk_scale = per_rows(kh, block_k)
    vmax = np.abs(vh).max(axis=2, keepdims=True)  # per channel over all tokens
    if pv_format == "e4m3":
        v_scale = np.where(vmax == 0, 1.0, f32(f32(vmax) * f32(1.0 / 448.0)))
        v8 = e4m3(f32(vh * f32(1.0 / v_scale)))
    else:
        v_scale = int8_scale(vmax)
        v8 = int8_codes(vh, v_scale)
    mask = visible(sq, sk, causal)
    c = scale * LOG2E
    acc = np.zeros((b, h, sq, d))
    m = np.full((b, h, sq), -np.inf)
    l = np.zeros((b, h, sq))
    for j0 in range(0, sk, block_k):
        cols = slice(j0, min(j0 + block_k, sk))
        s = np.einsum("bhqd,bhkd->bhqk", q8, k8[:, :, cols]) * sq_scale * np.swapaxes(sk_scale[:, :, cols], 2, 3) * c
        s = np.where(mask[:, cols], s, -np.inf)
        m_tile = s.max(axis=-1)
        m_new = np.maximum(m, m_tile)
        ref = np.where(np.isneginf(m_new), 0.0, m_new)
        tile_ref = np.where(np.isneginf(m_tile), 0.0, m_tile)
        alpha = np.exp2(np.where(np.isneginf(m), ref, m) - ref)
        if pv_format == "e4m3":  # P̃ at the running max: its 1 maps to 448
            e = np.exp2(s - ref[..., None]) * 448.0
            acc = acc * alpha[..., None] + np.einsum("bhqk,bhkd->bhqd", e4m3(e), v8[:, :, cols])
            l = l * alpha + e.sum(axis=-1)
            m = m_new
            continue
        e = np.exp2(s - tile_ref[..., None])  # the tile's own row max maps to 1
        p8 = np.floor(e * 127.0 + 0.5)  # ties: the library rounds half to even (measure-zero here)
        beta = np.exp2(tile_ref - ref)
        acc = acc * alpha[..., None] + np.einsum("bhqk,bhkd->bhqd", p8, v8[:, :, cols]) * (beta / 127.0)[..., None]
        l = l * alpha + beta * e.sum(axis=-1)
        m = m_new
    o = acc / np.where(l == 0, 1.0, l)[..., None] * v_scale
    return np.moveaxis(o, 1, 2)


# ----------------------------------------------------------------------------- Attn-QAT


def qat_forward(q, k, v, *, causal: bool, block_k: int, scale: float | None = None) -> np.ndarray:
    """Attn-QAT's NVFP4 forward for bf16 operands (docs/spec.md): o (B, Sq, Hq, D) float64."""
    qh, kh, vh = (fake_quant(x) for x in _heads(q, k, v))
    b, h, sq, d = qh.shape
    sk = kh.shape[2]
    c = (d ** -0.5 if scale is None else scale) * LOG2E
    mask = visible(sq, sk, causal)
    acc = np.zeros((b, h, sq, d))
    m = np.full((b, h, sq), -np.inf)
    l = np.zeros((b, h, sq))
    for j0 in range(0, sk, block_k):
        cols = slice(j0, min(j0 + block_k, sk))
        s = np.where(mask[:, cols], np.einsum("bhqd,bhkd->bhqk", qh, kh[:, :, cols]) * c, -np.inf)
        m_new = np.maximum(m, s.max(axis=-1))
        ref = np.where(np.isneginf(m_new), 0.0, m_new)
        p = np.exp2(s - ref[..., None])  # relative to the running row max at this tile
        n = p.shape[-1]
        pad = -(-n // 16) * 16 - n
        pq = fake_quant_p_bf16(np.pad(p, ((0, 0),) * 3 + ((0, pad),)))[..., :n]
        alpha = np.exp2(np.where(np.isneginf(m), ref, m) - ref)
        acc = acc * alpha[..., None] + np.einsum("bhqk,bhkd->bhqd", pq, vh[:, :, cols])
        l = l * alpha + p.sum(axis=-1)
        m = m_new
    return np.moveaxis(acc / np.where(l == 0, 1.0, l)[..., None], 1, 2)
