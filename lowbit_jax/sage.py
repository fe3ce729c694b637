"""SageAttention-style INT8 attention: public API, dispatch and pure-JAX reference.

Paper: SageAttention (Zhang et al., 2024) and SageBwd (trainable INT8 attention).
What is quantized where (shared/SPEC.md §1):

* K-smoothing (on by default): K' = K − mean over tokens, per (batch, kv-head,
  channel). The softmax is unchanged.
* Optional Q-smoothing: Q' = Q − q̄ per query block; q̄·K̂ᵀ is added back in fp32.
* Q̂, K̂: INT8 per block (one scale per tile, SageAttention's default) or per
  token; ``softmax_scale · log2(e)`` is folded into Q's scale.
* S = int32(Q̂K̂ᵀ)·s_Q·s_K in fp32, online softmax in base 2.
* P̃ quantized to INT8 per row and key tile, scale = row max / 127 (round half
  to even); V̂ INT8 per channel (over all tokens), stored transposed.
* O = Σ int32(P̂V̂)·s_P·s_V / l, accumulated in fp32.

The "xla" implementation below runs the same quantizers (imported from
:mod:`lowbit_jax.formats`) on whole arrays, so it matches the kernels up to
accumulation order and the hardware's exp2.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

from lowbit_jax import _checks
from lowbit_jax.formats import int8, sage_tiles, smoothing
from lowbit_jax.formats.sage_tiles import SageOperands
from pallas_kernels import quantize as quantize_kernels
from pallas_kernels import sage_fwd as sage_fwd_kernels
from pallas_kernels.configs import SageFwdConfig, sage_fwd_config

LOG2E = math.log2(math.e)
GRANULARITIES = ("per_block", "per_token")


# ----------------------------------------------------------------------------- public API


def sage_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    smooth_k: bool = True,
    smooth_q: bool = False,
    qk_granularity: Literal["per_block", "per_token"] = "per_block",
    implementation: Literal["pallas", "xla"] | None = None,
    interpret: bool = False,
    config: SageFwdConfig | None = None,
) -> jax.Array:
    """INT8 attention (SageAttention forward).

    Layout as ``jax.nn.dot_product_attention``. GQA/MQA: Hq a multiple of Hkv.

    Args:
      q: (B, Sq, Hq, D) bfloat16, float16 or float32.
      k, v: (B, Sk, Hkv, D), q's dtype. D in {32, 64, 128, 256}; any Sq, Sk ≥ 1.
      causal: causal mask, bottom-right aligned when Sq ≠ Sk (query i sees keys
        j ≤ i + Sk − Sq, as FlashAttention-2; ``jax.nn.dot_product_attention``
        is top-left aligned, so the two agree only for Sq = Sk). Rows that see
        no key give zeros.
      scale: softmax scale, default D**-0.5; a finite positive Python number.
      smooth_k: subtract the token mean of K before quantizing (recommended).
      smooth_q: subtract each query block's mean too (adds q̄·Kᵀ in fp32).
      qk_granularity: "per_block" (one INT8 scale per Q/K tile) or "per_token".
      implementation: "pallas" (the Triton kernels; on CPU only with
        ``interpret=True``), "xla" (the pure-JAX reference, same quantization),
        or None: pallas on GPU, xla elsewhere.
      interpret: run the Pallas kernels in interpret mode (CPU testing).
      config: tile configuration; default from :func:`sage_fwd_config`. Part of
        the numerics (per-tile scales), so compare implementations with one config.
    Returns:
      (B, Sq, Hq, D) in q's dtype.
    Raises:
      ValueError / TypeError on bad shapes, dtypes or options (before compiling).
    """
    o, _, _ = sage_forward(
        q, k, v, causal=causal, scale=scale, smooth_k=smooth_k, smooth_q=smooth_q,
        qk_granularity=qk_granularity, implementation=implementation, interpret=interpret, config=config,
    )
    return o


def sage_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    scale: float | None = None,
    smooth_k: bool = True,
    smooth_q: bool = False,
    qk_granularity: Literal["per_block", "per_token"] = "per_block",
    implementation: Literal["pallas", "xla"] | None = None,
    interpret: bool = False,
    config: SageFwdConfig | None = None,
) -> tuple[jax.Array, jax.Array, SageOperands]:
    """:func:`sage_attention` plus its residuals.

    Returns:
      ``(o, lse, operands)``: o as :func:`sage_attention`; ``lse`` float32
      (B, Hq, Sq), the base-2 log-sum-exp of the *smoothed, scaled* scores
      (``scale·log2 e·q·k'``; +inf for rows that see no key); the quantized
      :class:`SageOperands`.
    """
    options = resolve_options(
        q, k, v, causal=causal, scale=scale, smooth_k=smooth_k, smooth_q=smooth_q,
        qk_granularity=qk_granularity, implementation=implementation, interpret=interpret, config=config,
    )
    return _sage_forward_jit(q, k, v, **options)


def resolve_options(q, k, v, *, causal, scale, smooth_k, smooth_q, qk_granularity, implementation,
                    interpret, config) -> dict:
    """Validate everything eagerly and resolve defaults into static options."""
    shape = _checks.check_qkv(q, k, v)
    causal = _checks.check_bool("causal", causal)
    smooth_k = _checks.check_bool("smooth_k", smooth_k)
    smooth_q = _checks.check_bool("smooth_q", smooth_q)
    interpret = _checks.check_bool("interpret", interpret)
    _checks.check_choice("qk_granularity", qk_granularity, GRANULARITIES)
    scale = _checks.check_scale(scale, shape.head_dim)
    impl = _checks.check_implementation(implementation, interpret)
    if config is None:
        config = sage_fwd_config(shape.head_dim, causal)
    elif not isinstance(config, SageFwdConfig):
        raise TypeError(f"config must be a SageFwdConfig, got {type(config).__name__}")
    config = config.fitted(shape.seq_q, shape.seq_k)
    return dict(
        causal=causal, scale=scale, smooth_k=smooth_k, smooth_q=smooth_q,
        per_block=qk_granularity == "per_block", implementation=impl, interpret=interpret, config=config,
    )


@functools.partial(
    jax.jit,
    static_argnames=("causal", "scale", "smooth_k", "smooth_q", "per_block", "implementation", "interpret", "config"),
)
def _sage_forward_jit(q, k, v, *, causal, scale, smooth_k, smooth_q, per_block, implementation, interpret, config):
    use_pallas = implementation == "pallas"
    quantize = quantize_pallas if use_pallas else quantize_reference
    ops = quantize(q, k, v, scale=scale, smooth_k=smooth_k, smooth_q=smooth_q, per_block=per_block,
                   config=config, interpret=interpret)
    bias = smoothing_bias(ops, scale=scale) if smooth_q else None
    attend = functools.partial(
        sage_fwd_kernels.sage_attention_fwd, interpret=interpret) if use_pallas else sage_attention_reference
    o, lse = attend(
        ops.q, ops.q_scale, ops.k, ops.k_scale, ops.vt, ops.v_scale, bias,
        sq_len=q.shape[1], sk_len=k.shape[1], causal=causal, k_per_block=per_block,
        out_dtype=q.dtype, config=config,
    )
    return o, lse, ops


# ----------------------------------------------------------------------------- quantization


def _channel_stats(k, v, smooth_k):
    k_mean = smoothing.token_mean(k) if smooth_k else None
    return k_mean, sage_tiles.v_channel_scale(v)


def quantize_pallas(q, k, v, *, scale, smooth_k, smooth_q, per_block, config, interpret) -> SageOperands:
    """Quantize with the fused Pallas kernels (see :mod:`pallas_kernels.quantize`)."""
    k_mean, v_scale = _channel_stats(k, v, smooth_k)
    q8, qs, q_mean = quantize_kernels.sage_quantize_q(
        q, block=config.block_q, per_block=per_block, smooth_block=smooth_q, out_scale=scale * LOG2E,
        num_warps=config.quant_warps, interpret=interpret,
    )
    k8, ks, vt8 = quantize_kernels.sage_quantize_kv(
        k, v, k_mean, v_scale, block=config.block_k, per_block=per_block,
        num_warps=config.quant_warps, interpret=interpret,
    )
    return SageOperands(q8, qs, k8, ks, vt8, v_scale, q_mean)


def _to_tiles(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """(B, S, H, D) → zero-padded head-major tiles (B, H, nb, block, D), valid (nb, block, 1)."""
    b, s, h, d = x.shape
    nb = -(-s // block)
    xt = jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, nb * block - s), (0, 0)))
    valid = (jnp.arange(nb * block) < s).reshape(nb, block, 1)
    return xt.reshape(b, h, nb, block, d), valid


def quantize_reference(q, k, v, *, scale, smooth_k, smooth_q, per_block, config, interpret=False) -> SageOperands:
    """Pure-JAX twin of :func:`quantize_pallas`: the same tile functions on whole arrays."""
    del interpret
    k_mean, v_scale = _channel_stats(k, v, smooth_k)
    b, _, hq, d = q.shape
    hkv = k.shape[2]
    qt, qvalid = _to_tiles(q, config.block_q)
    q8, qs, q_mean = sage_tiles.quantize_qk_tile(
        qt, qvalid, None, per_block=per_block, smooth_block=smooth_q, out_scale=scale * LOG2E
    )
    kt, kvalid = _to_tiles(k, config.block_k)
    kmean_b = None if k_mean is None else k_mean[:, :, None, None, :]
    k8, ks, _ = sage_tiles.quantize_qk_tile(kt, kvalid, kmean_b, per_block=per_block, smooth_block=False,
                                            out_scale=1.0)
    vt, _ = _to_tiles(v, config.block_k)
    v8 = sage_tiles.quantize_v_tile(vt, kvalid, v_scale[:, :, None, None, :])
    sk_pad = kt.shape[2] * config.block_k
    return SageOperands(
        q=q8.reshape(b, hq, -1, d),
        q_scale=qs.reshape(b, hq, -1),
        k=k8.reshape(b, hkv, sk_pad, d),
        k_scale=ks.reshape(b, hkv, sk_pad),
        vt=jnp.swapaxes(v8.reshape(b, hkv, sk_pad, d), 2, 3),
        v_scale=v_scale,
        q_mean=None if q_mean is None else q_mean[:, :, :, 0, :],
    )


def smoothing_bias(ops: SageOperands, *, scale: float) -> jax.Array:
    """Q-smoothing correction q̄_block · K̂ᵀ·s_K · scale·log2 e in fp32.

    Returns:
      float32 (B, Hq, Sq_pad // block_q, Sk_pad), added to each query block's scores.
    """
    group = ops.q.shape[1] // ops.k.shape[1]
    k_deq = jnp.repeat(int8.dequantize(ops.k, ops.k_scale[..., None]), group, axis=1)
    bias = jnp.einsum("bhnd,bhkd->bhnk", ops.q_mean, k_deq, precision=jax.lax.Precision.HIGHEST)
    return bias * (scale * LOG2E)


# ----------------------------------------------------------------------------- attention reference


def sage_attention_reference(
    q8, q_scale, k8, k_scale, vt8, v_scale, bias, *, sq_len: int, sk_len: int, causal: bool,
    k_per_block: bool, out_dtype, config: SageFwdConfig,
) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX twin of :func:`pallas_kernels.sage_fwd.sage_attention_fwd` (same arguments).

    Not online: all key tiles at once, each with its own row max (which is what
    the kernel's per-tile P scale is), then merged exactly as the online softmax.
    """
    b, hq, sq_pad, d = q8.shape
    group = hq // k8.shape[1]
    bq, bk = config.block_q, config.block_k
    k8, k_scale, vt8, v_scale = (jnp.repeat(x, group, axis=1) for x in (k8, k_scale, vt8, v_scale))
    sk_pad = k8.shape[2]
    nkb = sk_pad // bk
    s_int = jnp.einsum("bhqd,bhkd->bhqk", q8, k8, preferred_element_type=jnp.int32)
    rows = jnp.arange(sq_pad)[:, None]
    cols = jnp.arange(sk_pad)[None, :]
    mask = cols < sk_len
    if causal:
        mask = mask & (cols <= rows + (sk_len - sq_len))
    mask = jnp.broadcast_to(mask, (sq_pad, sk_pad)).reshape(sq_pad, nkb, bk)
    if k_per_block and bias is None:
        c = q_scale[..., None] * k_scale.reshape(b, hq, nkb, bk)[:, :, None, :, 0]  # (B,H,Sq,nkb)
        x = int8.int32_as_biased_float(s_int).reshape(b, hq, sq_pad, nkb, bk)
        x = jnp.where(mask, x, -jnp.inf)
        mx = jnp.max(x, axis=-1)
        m_cur = (mx - int8.MAGIC) * c
        mx = jnp.where(mx == -jnp.inf, int8.MAGIC, mx)
        e = jnp.exp2((x - mx[..., None]) * c[..., None])
    else:
        s = s_int.astype(jnp.float32) * q_scale[..., None] * k_scale[:, :, None, :]
        if bias is not None:
            s = s + jnp.repeat(bias, bq, axis=2)
        s = jnp.where(mask, s.reshape(b, hq, sq_pad, nkb, bk), -jnp.inf)
        m_cur = jnp.max(s, axis=-1)
        e = jnp.exp2(s - jnp.where(m_cur == -jnp.inf, 0.0, m_cur)[..., None])
    m = jnp.max(m_cur, axis=-1)
    m_ref = jnp.where(m == -jnp.inf, 0.0, m)
    beta = jnp.exp2(m_cur - m_ref[..., None])
    l = jnp.sum(beta * jnp.sum(e, axis=-1), axis=-1)
    p8 = int8.encode_unit_interval(e)
    pv = jnp.einsum("bhqnk,bhdnk->bhqnd", p8, vt8.reshape(b, hq, d, nkb, bk), preferred_element_type=jnp.int32)
    acc = jnp.sum(pv.astype(jnp.float32) * (beta * (1.0 / int8.QMAX))[..., None], axis=3)
    empty = l == 0.0
    inv_l = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    o = acc * inv_l[..., None] * v_scale[:, :, None, :]
    lse = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))
    o = jnp.swapaxes(o, 1, 2)[:, :sq_len].astype(out_dtype)
    return o, lse[..., :sq_len]
