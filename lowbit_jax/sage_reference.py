"""Pure-JAX references of SageAttention / SageBwd with the kernels' exact quantization.

Every quantizer comes from :mod:`lowbit_jax.formats`, the same functions the
Pallas kernels call on tiles; here they run on whole arrays (tiles as extra
dims). The kernels must match these up to accumulation order and exp2.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.numerics import e4m3, int8, sage_tiles, smoothing
from pallas_kernels.numerics.sage_tiles import SageOperands
from pallas_kernels.configs import SageFwdConfig
from pallas_kernels.numerics.tile_ranges import visible

LOG2E = math.log2(math.e)


def channel_stats(k: jax.Array, v: jax.Array, smooth_k: bool,
                  v_format: str = "int8") -> tuple[jax.Array | None, jax.Array]:
    """K's token mean (B, Hkv, D) f32 if smoothing, and V's per-channel scale (B, Hkv, D) f32 for ``v_format``."""
    k_mean = smoothing.token_mean(k) if smooth_k else None
    return k_mean, sage_tiles.v_channel_scale(v, v_format)


def to_tiles(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """(B, S, H, D) → zero-padded head-major tiles (B, H, nb, block, D), valid (nb, block, 1)."""
    b, s, h, d = x.shape
    nb = -(-s // block)
    xt = jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, nb * block - s), (0, 0)))
    valid = (jnp.arange(nb * block) < s).reshape(nb, block, 1)
    return xt.reshape(b, h, nb, block, d), valid


def quantize_reference(q, k, v, *, scale, smooth_k, smooth_q, per_block, config, transposed=False,
                       interpret=False) -> SageOperands:
    """Pure-JAX twin of the fused quantize kernels (same tile functions on whole arrays).

    Args:
      q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D).
    Returns:
      :class:`SageOperands` (with Q̂ᵀ, K̂ᵀ when ``transposed``).
    """
    del interpret
    k_mean, v_scale = channel_stats(k, v, smooth_k, config.pv_format)
    b, _, hq, d = q.shape
    hkv = k.shape[2]
    qt, qvalid = to_tiles(q, config.block_q)
    q8, qs, q_mean = sage_tiles.quantize_qk_tile(
        qt, qvalid, None, per_block=per_block, smooth_block=smooth_q, out_scale=scale * LOG2E
    )
    kt, kvalid = to_tiles(k, config.block_k)
    kmean_b = None if k_mean is None else k_mean[:, :, None, None, :]
    k8, ks, _ = sage_tiles.quantize_qk_tile(kt, kvalid, kmean_b, per_block=per_block, smooth_block=False,
                                            out_scale=1.0)
    vt, _ = to_tiles(v, config.block_k)
    v8 = sage_tiles.quantize_v_tile(vt, kvalid, v_scale[:, :, None, None, :], config.pv_format, arithmetic=True)
    sk_pad = kt.shape[2] * config.block_k
    q8 = q8.reshape(b, hq, -1, d)
    k8 = k8.reshape(b, hkv, sk_pad, d)
    return SageOperands(
        q=q8,
        q_scale=qs.reshape(b, hq, -1),
        k=k8,
        k_scale=ks.reshape(b, hkv, sk_pad),
        vt=jnp.swapaxes(v8.reshape(b, hkv, sk_pad, d), 2, 3),
        v_scale=v_scale,
        q_mean=None if q_mean is None else q_mean[:, :, :, 0, :],
        q_t=jnp.swapaxes(q8, 2, 3) if transposed else None,
        k_t=jnp.swapaxes(k8, 2, 3) if transposed else None,
    )


def smoothing_bias(ops: SageOperands, *, scale: float) -> jax.Array:
    """Q-smoothing correction q̄_block · K̂ᵀ·s_K · scale·log2 e in fp32.

    Returns:
      float32 (B, Hq, Sq_pad // block_q, Sk_pad), added to each query block's base-2 scores.
    """
    group = ops.q.shape[1] // ops.k.shape[1]
    k_deq = jnp.repeat(int8.dequantize(ops.k, ops.k_scale[..., None]), group, axis=1)
    bias = jnp.einsum("bhnd,bhkd->bhnk", ops.q_mean, k_deq, precision=jax.lax.Precision.HIGHEST)
    return bias * (scale * LOG2E)


def sage_attention_reference(
    q8, q_scale, k8, k_scale, vt8, v_scale, bias, *, sq_len: int, sk_len: int, causal: bool,
    k_per_block: bool, out_dtype, config: SageFwdConfig,
) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX twin of :func:`pallas_kernels.sage_fwd.sage_attention_fwd` (same arguments).

    Not online: all key tiles at once, each with its own row max (which is what
    the kernel's per-tile P scale is), then merged exactly as the online softmax. With e4m3 codes in ``vt8``
    (``config.pv_format``), P̃ of each tile is taken at the running max up to it (a cumulative max over tiles).
    """
    b, hq, sq_pad, d = q8.shape
    group = hq // k8.shape[1]
    bq, bk = config.block_q, config.block_k
    k8, k_scale, vt8, v_scale = (jnp.repeat(x, group, axis=1) for x in (k8, k_scale, vt8, v_scale))
    sk_pad = k8.shape[2]
    nkb = sk_pad // bk
    s_int = jnp.einsum("bhqd,bhkd->bhqk", q8, k8, preferred_element_type=jnp.int32)
    mask = visible(jnp.arange(sq_pad)[:, None], jnp.arange(sk_pad)[None, :], sq_len, sk_len, causal)
    mask = jnp.broadcast_to(mask, (sq_pad, sk_pad)).reshape(sq_pad, nkb, bk)
    if k_per_block and bias is None:  # the scores stay unscaled until the exponent (as the kernels)
        c = q_scale[..., None] * k_scale.reshape(b, hq, nkb, bk)[:, :, None, :, 0]  # (B,H,Sq,nkb)
        x = int8.int32_as_biased_float(s_int).reshape(b, hq, sq_pad, nkb, bk)
        x = jnp.where(mask, x, -jnp.inf)
        mx = jnp.max(x, axis=-1)
        m_cur = (mx - int8.MAGIC) * c
    else:
        c = None
        s = s_int.astype(jnp.float32) * q_scale[..., None] * k_scale[:, :, None, :]
        if bias is not None:
            s = s + jnp.repeat(bias, bq, axis=2)
        s = jnp.where(mask, s.reshape(b, hq, sq_pad, nkb, bk), -jnp.inf)
        m_cur = jnp.max(s, axis=-1)
    if vt8.dtype == e4m3.DTYPE:
        scores = s if c is None else jnp.where(mask, (x - int8.MAGIC) * c[..., None], -jnp.inf)
        return _e4m3_pv(scores, c, m_cur, vt8, v_scale, sq_len=sq_len, out_dtype=out_dtype)
    if c is None:
        e = jnp.exp2(s - jnp.where(m_cur == -jnp.inf, 0.0, m_cur)[..., None])
    else:
        mx = jnp.where(mx == -jnp.inf, int8.MAGIC, mx)
        e = jnp.exp2((x - mx[..., None]) * c[..., None])
    m = jnp.max(m_cur, axis=-1)
    m_ref = jnp.where(m == -jnp.inf, 0.0, m)
    beta = jnp.exp2(m_cur - m_ref[..., None])
    l = jnp.sum(beta * jnp.sum(e, axis=-1), axis=-1)
    p8 = int8.encode_unit_interval(e)
    pv = jnp.einsum("bhqnk,bhdnk->bhqnd", p8, vt8.reshape(b, hq, d, nkb, bk), preferred_element_type=jnp.int32)
    acc = jnp.sum(pv.astype(jnp.float32) * (beta * (1.0 / int8.QMAX))[..., None], axis=3)
    o = acc * int8.reciprocal_or_zero(l)[..., None] * v_scale[:, :, None, :]
    lse = sage_tiles.base2_lse(m, l)
    o = jnp.swapaxes(o, 1, 2)[:, :sq_len].astype(out_dtype)
    return o, lse[..., :sq_len]


def _e4m3_pv(scores, c, m_cur, vt8, v_scale, *, sq_len, out_dtype):
    """The e4m3 P·V of :func:`sage_attention_reference` from the scaled, masked base-2 scores (B, H, Sq_pad, tiles,
    block_k), their per-tile scales ``c`` (None if scaled per token) and row maxima ``m_cur``: P̃ of key tile n at
    the running row max M_n (the maximum of the tiles' maxima up to n), as e4m3 codes of P̃·448;
    O = Σ_n exp2(M_n − M)·(P̂_n V̂_n) with each tile's product summed in float32, l = Σ_n exp2(M_n − M)·Σ P̃_n·448
    (unquantized)."""
    b, hq, sq_pad, nkb, bk = scores.shape
    d = vt8.shape[2]
    run = lax.cummax(m_cur, axis=3)  # M_n
    run_ref = jnp.where(run == -jnp.inf, 0.0, run)
    e = jnp.exp2(scores - (run_ref - e4m3.LOG2_MAX)[..., None])  # P̃·448 ∈ [0, 448]
    m = run[..., -1]
    m_ref = jnp.where(m == -jnp.inf, 0.0, m)
    gamma = jnp.exp2(run_ref - m_ref[..., None])  # tile n's weight at the final max
    l = jnp.sum(gamma * jnp.sum(e, axis=-1), axis=-1)
    if c is not None:  # a non-finite scale makes the row NaN (as the kernels): its scores' signs could hide it
        l = l + jnp.sum(c - c, axis=-1)
    p8 = e4m3.rounded(e)  # the kernels' e4m3 codes of P̃·448, as values (e4m3.rounded: why not a cast)
    v = vt8.reshape(b, hq, d, nkb, bk).astype(jnp.float32)
    pv = jnp.einsum("bhqnk,bhdnk->bhqnd", p8, v, precision=lax.Precision.HIGHEST)
    acc = jnp.sum(pv * gamma[..., None], axis=3)
    o = acc * int8.reciprocal_or_zero(l)[..., None] * v_scale[:, :, None, :]
    lse = sage_tiles.base2_lse(m - e4m3.LOG2_MAX, l)
    o = jnp.swapaxes(o, 1, 2)[:, :sq_len].astype(out_dtype)
    return o, lse[..., :sq_len]


def _int8_product(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """Exact product of INT8 codes as float32 (integer sums < 2**24 are exact in fp32).

    Computed on float32 operands at HIGHEST precision rather than as an
    int8×int8→int32 dot: XLA on the GPU (jax 0.11.2) returned a wrong dV from
    the int8 form in a GQA/causal case, while the Pallas kernel matched the CPU
    reference.
    """
    return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def sage_backward_reference(
    ops: SageOperands, bias: jax.Array | None, o: jax.Array, lse: jax.Array, do: jax.Array, *,
    sq_len: int, sk_len: int, causal: bool, per_block: bool, scale: float, config: SageFwdConfig,
    intermediates: bool = False,
):
    """Pure-JAX twin of the SageBwd kernels (``lowbit_jax.sage._backward_pallas``).

    Scans over query tiles (memory O(S·D) per step, not S²·D). Same quantization
    as the kernels: dO INT8 per query tile, P INT8 per key row of each tile for
    dV, dS INT8 per tile — (bwd_block_q × bwd_block_k) for dK, (bwd_block_q × dq_block_k)
    for dQ; with ``config.ds_scale="row"`` per key of the dK tile and per query row of
    the dQ tile — (with per-token Q/K scales folded in first), dP = dO·Ṽᵀ with
    Ṽ = V̂·s_V rounded to dO's dtype, fp32 accumulation.

    Args:
      ops: the forward's :class:`SageOperands` (Q̂ᵀ/K̂ᵀ not needed here).
      bias: Q-smoothing score bias or None; o, lse, do as the kernel wrapper.
      intermediates: also return a dict of D, P, dP, dS (head-major, padded).
    Returns:
      (dq (B, Sq, Hq, D), dk, dv (B, Sk, Hkv, D)) in do's dtype [, intermediates].
    """
    b, hq, sq_pad, d = ops.q.shape
    hkv, sk_pad = ops.k.shape[1], ops.k.shape[2]
    group = hq // hkv
    bq, bk = config.bwd_block_q, config.bwd_block_k
    nqb, nkb = sq_pad // bq, sk_pad // bk
    q_ratio = config.block_q // bq  # backward tiles per forward query block
    rep = lambda x: jnp.repeat(x, group, axis=1)  # noqa: E731
    k8, ks, vt8, vs = rep(ops.k), rep(ops.k_scale), rep(ops.vt), rep(ops.v_scale)
    bk_q = config.dq_block_k  # key tiles of the dQ kernel (its dS quantization tiles)
    nkb_q = sk_pad // bk_q
    k_q_tiles = k8.reshape(b, hq, nkb_q, bk_q, d)
    ks_q_tiles = ks.reshape(b, hq, nkb_q, bk_q)

    # preprocess (as the kernel): D, dO per tile in INT8; dP's 16-bit operands dO and Ṽ = V̂·s_V
    pad_rows = lambda x: jnp.pad(x, ((0, 0), (0, sq_pad - sq_len), (0, 0), (0, 0)))  # noqa: E731
    o_p, _ = to_tiles(pad_rows(o.astype(jnp.float32)), bq)
    do_p, _ = to_tiles(pad_rows(do.astype(jnp.float32)), bq)  # (B, H, nqb, bq, D)
    delta = jnp.sum(o_p * do_p, axis=-1)
    do_16 = do_p.astype(do.dtype)
    do8, do_scale = int8.quantize(do_p, (-2, -1))  # scale (B, H, nqb, 1, 1)
    vd_t = sage_tiles.dequantize_v_t(vt8, vs, do.dtype)  # Ṽᵀ (B, H, D, Sk_pad)
    lse_p = sage_tiles.pad_lse(lse, sq_pad).reshape(b, hq, nqb, bq)
    q_tiles = ops.q.reshape(b, hq, nqb, bq, d)
    qs_tiles = ops.q_scale.reshape(b, hq, nqb, bq)
    cols = jnp.arange(sk_pad)
    has_bias = bias is not None

    def step(carry, xs):
        dk, dv = carry
        i, q_i, qs_i, lse_i, delta_i, do16_i, do8_i, dosc_i, bias_i, qmean_i = xs
        rows = i * bq + jnp.arange(bq)
        t = jnp.einsum("bhqd,bhkd->bhqk", q_i, k8, preferred_element_type=jnp.int32).astype(jnp.float32)
        t = t * qs_i[..., None] * ks[:, :, None, :]
        if has_bias:
            t = t + bias_i[:, :, None, :]
        t = jnp.where(visible(rows[:, None], cols[None, :], sq_len, sk_len, causal), t, -jnp.inf)
        p = jnp.exp2(t - lse_i[..., None])
        dp = jnp.einsum("bhqd,bhdk->bhqk", do16_i, vd_t, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_i[..., None])
        # dV += P̂ᵀ dÔ, P per key row of the tile
        pt = p.reshape(b, hq, bq, nkb, bk)
        p8, p_scale = int8.quantize_unit(pt, 2)
        dv_scale = p_scale[:, :, 0] * dosc_i  # (B, H, nkb, bk) · (B, H, 1, 1)
        dv_int = _int8_product("bhqjk,bhqd->bhjkd", p8, do8_i)
        dv = dv + (dv_int * dv_scale[..., None]).reshape(b, hq, sk_pad, d)
        # dS tiles: (bq × bk) for dK (reduction over queries), (bq × dq_block_k) for dQ (over keys)
        dst = ds.reshape(b, hq, bq, nkb, bk)
        dsq_t = ds.reshape(b, hq, bq, nkb_q, bk_q)
        # one scale per tile, or per key (dK) / per query row and key tile (dQ) with ds_scale="row"
        k_axes, q_axes = ((2,), (4,)) if config.ds_scale == "row" else ((2, 4), (2, 4))
        if per_block:
            dsk8, dsk_fac = int8.quantize_half_even(dst, k_axes)
            dsk_fac = dsk_fac * qs_i[:, :, :1, None, None] / LOG2E
            dsq8, dsq_fac = int8.quantize_half_even(dsq_t, q_axes)
            dsq_fac = dsq_fac * ks_q_tiles[:, :, None, :, :1] * scale
        else:
            dsk8, dsk_fac = int8.quantize_half_even(dst * qs_i[:, :, :, None, None], k_axes)
            dsk_fac = dsk_fac / LOG2E
            dsq8, dsq_fac = int8.quantize_half_even(dsq_t * ks_q_tiles[:, :, None], q_axes)
            dsq_fac = dsq_fac * scale
        # factors: dK (B, H, 1, nkb, bk|1) → per key; dQ (B, H, bq|1, nkb_q, 1) → per query row
        dk_int = _int8_product("bhqjk,bhqd->bhjkd", dsk8, q_i)
        dk = dk + (dk_int * dsk_fac[:, :, 0, :, :, None]).reshape(b, hq, sk_pad, d)
        if has_bias:
            dk = dk + scale * jnp.sum(ds, axis=2)[..., None] * qmean_i[:, :, None, :]
        dq_int = _int8_product("bhqjk,bhjkd->bhqjd", dsq8, k_q_tiles)
        dq_i = jnp.sum(dq_int * dsq_fac, axis=3)
        extra = (p, dp, ds) if intermediates else ()
        return (dk, dv), (dq_i,) + extra

    zeros = jnp.zeros((b, hq, sk_pad, d), jnp.float32)
    per_tile = lambda x: None if x is None else jnp.moveaxis(x, 2, 0)  # noqa: E731
    per_fwd_block = lambda x: None if x is None else per_tile(jnp.repeat(x, q_ratio, axis=2))  # noqa: E731
    xs = (jnp.arange(nqb), per_tile(q_tiles), per_tile(qs_tiles), per_tile(lse_p), per_tile(delta), per_tile(do_16),
          per_tile(do8), per_tile(do_scale), per_fwd_block(bias), per_fwd_block(ops.q_mean))
    (dk, dv), outs = jax.lax.scan(step, (zeros, zeros), xs)
    dq = jnp.moveaxis(outs[0], 0, 2).reshape(b, hq, sq_pad, d)
    dq = jnp.swapaxes(dq, 1, 2)[:, :sq_len].astype(do.dtype)

    def kv_grad(x):
        x = x.reshape(b, hkv, group, sk_pad, d).sum(axis=2)
        return jnp.swapaxes(x, 1, 2)[:, :sk_len].astype(do.dtype)

    grads = (dq, kv_grad(dk), kv_grad(dv))
    if not intermediates:
        return grads
    full = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, hq, sq_pad, sk_pad)[:, :, :sq_len, :sk_len]  # noqa: E731
    return grads, {"D": delta.reshape(b, hq, sq_pad)[:, :, :sq_len], "P": full(outs[1]), "dP": full(outs[2]),
                   "dS": full(outs[3])}
