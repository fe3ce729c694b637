"""SageBwd: the INT8 attention backward, Pallas lowered through Triton.

Kernels (docs/spec.md, SageBwd):

* ``sage_bwd_preprocess`` — per query tile: D = rowsum(dO∘O) in fp32 and dO
  quantized to INT8 with one scale per tile, written transposed (D, Sq) so
  dV = P̂ᵀ·dÔ contracts over contiguous memory.
* ``sage_bwd_kv_operands`` — per key block: the fused Mosaic dK/dV/dQ kernel's K̂ and Ṽ
  (V̂ᵀ dequantized and transposed) with their keys in ``key_pairs`` order, one pass
  instead of XLA's two transposes.
* ``sage_bwd_dkdv`` — one program per key tile (and batch, kv head), looping over
  the query tiles of every query head of its GQA group: recompute Sᵀ = K̂Q̂ᵀ (INT8),
  Pᵀ = exp2(Sᵀ − L); dV += P̂ᵀdÔ (INT8, P per key row of the tile, dO per tile);
  dPᵀ = Ṽ·dOᵀ (16-bit, fp32 accumulation; Ṽ = V̂·s_V rounded to dO's dtype, built
  in-kernel once per program); dSᵀ = Pᵀ∘(dPᵀ − D) quantized per tile; dK += dŜᵀQ̂ (INT8).
* ``sage_bwd_dq`` — one program per query tile, looping over key tiles of
  ``dq_block_k``: the same S, P, dP, dS, quantized per (bwd_block_q × dq_block_k)
  tile for dQ += dŜK̂ (INT8).
  Deterministic and without an fp32 workspace (fusing it into the Triton dK/dV kernel
  with fp32 atomic adds measured 4× slower).

Six of the seven attention matmuls are INT8 (forward QKᵀ and PV; backward QKᵀ
recompute, dV, dQ, dK); only dP is 16-bit. Every INT8 product contracts over the
contiguous dim of both operands, using the transposed copies Q̂ᵀ, K̂ᵀ, dÔᵀ. dO is
read in the caller's (B, S, H, D) layout; no 16-bit copy of V or dO is made.

Scale bookkeeping: the forward's Q scale includes ``softmax_scale·log2 e`` and the
scores are in base 2; dS is the gradient w.r.t. the natural-log scores. With
per-token Q/K scales (they vary along the dK/dQ reduction axes) the scale is
folded into dS before the per-tile quantization; with per-block scales it is a
per-tile constant pulled out of the product.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.numerics import int8
from pallas_kernels.numerics.sage_tiles import dequantize_v_t
from pallas_kernels._triton import compiler_params, load_rows, pl, row_mask, store_rows
from pallas_kernels.configs import SageFwdConfig
from pallas_kernels import key_pairs
from pallas_kernels.operand_order import check_block, from_operand_order, transposed
from pallas_kernels.numerics.tile_ranges import key_tile_range, query_tile_range, visible

_DOT_NT = (((1,), (1,)), ((), ()))  # contract the last dim of both operands
LOG2E = math.log2(math.e)


def _dot_i8(a, b):
    return lax.dot_general(a, b, _DOT_NT, preferred_element_type=jnp.int32).astype(jnp.float32)


def _dot_f32(a, b):
    return lax.dot_general(a, b, _DOT_NT, preferred_element_type=jnp.float32)


_TILE = (0, 1)  # ψ with one scale for the whole 2-D tile (scale shape (1, 1))


# ----------------------------------------------------------------------------- preprocess


def _preprocess_kernel(o_ref, do_ref, delta_ref, dot_ref, dosc_ref, *zero_ref, block, seq_len, ragged,
                       operand_order):
    for ref in zero_ref:  # the fused backward's float32 dQ accumulator, zeroed as dO∘O is read (cuDNN's way)
        ref[...] = jnp.zeros(ref.shape, ref.dtype)
    valid = row_mask(pl.program_id(0) * block, block, seq_len)
    mask = valid if ragged else None
    o = load_rows(o_ref, mask).astype(jnp.float32)
    do = load_rows(do_ref, mask).astype(jnp.float32)
    delta_ref[...] = jnp.sum(o * do, axis=1)
    codes, scale = int8.quantize(do, _TILE)
    dot_ref[...] = transposed(codes, operand_order)
    dosc_ref[...] = jnp.broadcast_to(scale[0], (block,))


@functools.partial(jax.jit, static_argnames=("config", "operand_order", "zero_dq", "interpret"))
def sage_bwd_preprocess(o: jax.Array, do: jax.Array, *, config: SageFwdConfig, operand_order: bool = False,
                        zero_dq: bool = False, interpret: bool = False):
    """D = rowsum(dO∘O) and INT8 dOᵀ.

    Args:
      o, do: (B, Sq, Hq, D) output and its cotangent.
      operand_order: dÔᵀ's queries in :mod:`pallas_kernels.operand_order` (what the Mosaic dK/dV kernel takes;
        ``config.bwd_block_q`` a multiple of 16).
      zero_dq: also return a zeroed float32 (B, Sq_pad, Hq, D) array, the fused Mosaic backward's dQ
        accumulator (``sage_bwd_mosaic.sage_bwd_dkdv_mosaic``'s ``dq_zeros``), written by the same programs
        that read dO and O (as cuDNN's preprocess does) instead of a separate fill.
    Returns:
      delta float32 (B, Hq, Sq_pad); dÔᵀ int8 (B, Hq, D, Sq_pad); dO scale float32
      (B, Hq, Sq_pad) (one value per tile, repeated); with ``zero_dq`` the zeroed accumulator after them.
    """
    b, sq, hq, d = o.shape
    bq = config.bwd_block_q
    sq_pad = pl.cdiv(sq, config.block_q) * config.block_q  # the forward's padding
    nqb = sq_pad // bq
    row_spec = pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0))
    if operand_order:
        check_block(bq, "config.bwd_block_q")
    kernel = functools.partial(_preprocess_kernel, block=bq, seq_len=sq, ragged=sq_pad != sq,
                               operand_order=operand_order)
    zero_out = ([(pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
                  jax.ShapeDtypeStruct((b, sq_pad, hq, d), jnp.float32))] if zero_dq else [])
    return pl.pallas_call(
        kernel,
        grid=(nqb, b, hq),
        in_specs=[row_spec, row_spec],
        out_specs=[
            pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i)),
            pl.BlockSpec((None, None, d, bq), lambda i, bi, hi: (bi, hi, 0, i)),
            pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, i)),
            *(spec for spec, _ in zero_out),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hq, sq_pad), jnp.float32),
            jax.ShapeDtypeStruct((b, hq, d, sq_pad), jnp.int8),
            jax.ShapeDtypeStruct((b, hq, sq_pad), jnp.float32),
            *(shape for _, shape in zero_out),
        ],
        compiler_params=compiler_params(config.quant_warps, 1),
        interpret=interpret,
        name="sage_bwd_preprocess",
    )(o, do)


# ----------------------------------------------------------------------------- K̂ and Ṽ for the fused Mosaic kernel

#: keys per program of :func:`sage_bwd_kv_operands`
KV_OPERAND_BLOCK = 128


def _kv_operands_kernel(k_ref, vt_ref, vs_ref, kp_ref, vd_ref, *, v_operand_order):
    kp_ref[...] = key_pairs.to_pair_order(k_ref[...], 0)
    vd = dequantize_v_t(vt_ref[...], vs_ref[...], vd_ref.dtype).T  # (keys, D)
    if v_operand_order:
        vd = from_operand_order(vd, 0)
    vd_ref[...] = key_pairs.to_pair_order(vd, 0)


@functools.partial(jax.jit, static_argnames=("dtype", "v_operand_order", "block", "num_warps", "interpret"))
def sage_bwd_kv_operands(k8: jax.Array, vt8: jax.Array, v_scale: jax.Array, *, dtype, v_operand_order: bool = False,
                         block: int = KV_OPERAND_BLOCK, num_warps: int = 4,
                         interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The fused Mosaic dK/dV/dQ kernel's K̂ and Ṽ, keys in :mod:`pallas_kernels.key_pairs` order, in one pass.

    The values of ``key_pairs.to_pair_order(k8, 2)`` and of ``to_pair_order(sage_bwd_mosaic.dequantized_v(vt8,
    v_scale, dtype, keys_in_operand_order=v_operand_order), 2)``, which XLA computes as two transposes
    (:func:`pallas_kernels.numerics.sage_tiles.dequantize_v_t` is the dequantization here too).

    Args:
      k8: int8 (B, Hkv, Sk_pad, D) K̂ in natural key order.
      vt8: int8 (B, Hkv, D, Sk_pad) V̂ᵀ; its keys in :mod:`pallas_kernels.operand_order` if ``v_operand_order``
        (the Mosaic forward's).
      v_scale: float32 (B, Hkv, D) per-channel V scale.
      dtype: Ṽ's dtype (dO's).
      block: keys per program at most (the largest divisor of Sk_pad that divides it; a multiple of 16).
    Returns:
      K̂ int8 (B, Hkv, Sk_pad, D) and Ṽ (B, Hkv, Sk_pad, D) in ``dtype``, keys in pair order.
    """
    b, h, s_pad, d = k8.shape
    block = math.gcd(block, s_pad)  # the largest divisor of Sk_pad that divides block
    if block % key_pairs.BLOCK:
        raise ValueError(f"Sk_pad={s_pad} and block must share a multiple of {key_pairs.BLOCK} keys, got {block}")
    rows = pl.BlockSpec((None, None, block, d), lambda bi, hi, i: (bi, hi, i, 0))
    return pl.pallas_call(
        functools.partial(_kv_operands_kernel, v_operand_order=v_operand_order),
        grid=(b, h, s_pad // block),
        in_specs=[rows, pl.BlockSpec((None, None, d, block), lambda bi, hi, i: (bi, hi, 0, i)),
                  pl.BlockSpec((None, None, d), lambda bi, hi, i: (bi, hi, 0))],
        out_specs=[rows, rows],
        out_shape=[jax.ShapeDtypeStruct(k8.shape, jnp.int8), jax.ShapeDtypeStruct(k8.shape, dtype)],
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="sage_bwd_kv_operands",
    )(k8, vt8, v_scale)


# ----------------------------------------------------------------------------- dK, dV


def _dkdv_kernel(
    q_ref, qs_ref, qt_ref, lse_ref, delta_ref, do_ref, dot_ref, dosc_ref, k_ref, ks_ref, vt_ref, vs_ref, *refs,
    block_q, block_k, sq_len, sk_len, sq_pad, sk_pad, causal, per_block, has_bias, scale, group, n_qblocks, q_ratio,
    ds_axes,
):
    if has_bias:
        bias_ref, qmean_ref, dk_ref, dv_ref = refs
    else:
        dk_ref, dv_ref = refs
    k_start = pl.program_id(0) * block_k
    k = k_ref[...]  # (bk, D) int8
    ks = ks_ref[...]  # (bk,)
    vd = dequantize_v_t(vt_ref[...], vs_ref[...], do_ref.dtype).T  # (bk, D) Ṽ in dO's dtype
    head_dim = k.shape[-1]
    cols = k_start + jnp.arange(block_k, dtype=jnp.int32)
    ragged_k = sk_pad != sk_len  # some tiles hold padding keys (possibly only padding)
    ragged_q = sq_pad != sq_len
    fwd_block = (lambda i: i) if q_ratio == 1 else (lambda i: lax.div(i, jnp.int32(q_ratio)))
    # Query tiles that see any key of this tile, and the first one that sees all of them.
    i_first, i_unmasked = query_tile_range(k_start, block_q=block_q, block_k=block_k, sq_len=sq_len, sk_len=sk_len,
                                           causal=causal, n_qblocks=n_qblocks)

    def step(i, carry, g, masked):
        dk_acc, dv_acc = carry
        q_start = pl.multiple_of(i * block_q, block_q)
        rows = pl.ds(q_start, block_q)
        q = q_ref[g, rows, :]
        if per_block:  # one scale per key tile and per query tile: one multiply per score
            q0 = qs_ref[g, q_start]
            st = _dot_i8(k, q) * (ks_ref[0] * q0)  # (bk, bq) base-2 scores
        else:
            qs = qs_ref[g, rows]
            st = _dot_i8(k, q) * ks[:, None] * qs[None, :]
        if has_bias:
            st = st + bias_ref[g, fwd_block(i), pl.ds(k_start, block_k)][:, None]
        if masked or ragged_k:
            q_idx = q_start + jnp.arange(block_q, dtype=jnp.int32)
            st = jnp.where(visible(q_idx[None, :], cols[:, None], sq_len, sk_len, causal), st, -jnp.inf)
        pt = jnp.exp2(st - lse_ref[g, rows][None, :])  # (bk, bq); +inf LSE rows give 0
        # dV += P̂ᵀ dÔ: P per key row of the tile, dO one scale per query tile.
        p8, p_scale = int8.quantize_unit(pt, 1, truncating_convert=True)
        dv_acc = dv_acc + _dot_i8(p8, dot_ref[g, :, rows]) * (p_scale * dosc_ref[g, q_start])
        # dSᵀ = Pᵀ ∘ (dPᵀ − D); dK += dŜᵀ Q̂ (INT8, one dS scale per tile).
        do = load_rows(do_ref.at[rows, g, :], row_mask(q_start, block_q, sq_len) if ragged_q else None)
        dpt = _dot_f32(vd, do)
        dst = pt * (dpt - delta_ref[g, rows][None, :])
        if per_block:
            ds8, ds_scale = int8.quantize_half_even(dst, ds_axes, truncating_convert=True)
            factor = ds_scale * q0 * (1.0 / LOG2E)
        else:
            ds8, ds_scale = int8.quantize_half_even(dst * qs[None, :], ds_axes, truncating_convert=True)
            factor = ds_scale * (1.0 / LOG2E)
        dk_acc = dk_acc + _dot_i8(ds8, qt_ref[g, :, rows]) * factor
        if has_bias:  # Q-smoothing: the removed block mean q̄ also multiplies dS
            dk_acc = dk_acc + (scale * jnp.sum(dst, axis=1))[:, None] * qmean_ref[g, fwd_block(i), :][None, :]
        return dk_acc, dv_acc

    carry = (jnp.zeros((block_k, head_dim), jnp.float32), jnp.zeros((block_k, head_dim), jnp.float32))

    def head(g, carry):  # each query head of the GQA group
        if causal:
            carry = lax.fori_loop(i_first, i_unmasked, functools.partial(step, g=g, masked=True), carry)
        return lax.fori_loop(i_unmasked, n_qblocks, functools.partial(step, g=g, masked=False), carry)

    carry = lax.fori_loop(0, group, head, carry)
    dk, dv = carry
    valid = row_mask(k_start, block_k, sk_len) if ragged_k else None
    store_rows(dk_ref, dk.astype(dk_ref.dtype), valid)
    store_rows(dv_ref, dv.astype(dv_ref.dtype), valid)


# ----------------------------------------------------------------------------- dQ


def _dq_kernel(
    q_ref, qs_ref, lse_ref, delta_ref, do_ref, k_ref, ks_ref, kt_ref, vt_ref, vs_ref, *refs,
    block_q, block_k, sq_len, sk_len, sq_pad, causal, per_block, has_bias, scale, ds_axes,
):
    if has_bias:
        bias_ref, dq_ref = refs
    else:
        (dq_ref,) = refs
    qi = pl.program_id(0)
    q_start = qi * block_q
    q = q_ref[...]
    qs = qs_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    q_valid = row_mask(q_start, block_q, sq_len) if sq_pad != sq_len else None
    do = load_rows(do_ref, q_valid)
    vs = vs_ref[...]
    rows = q_start + jnp.arange(block_q, dtype=jnp.int32)
    n_unmasked, n_total = key_tile_range(q_start, block_q=block_q, block_k=block_k, sq_len=sq_len, sk_len=sk_len,
                                         causal=causal)

    def step(j, acc, masked):
        start = pl.multiple_of(j * block_k, block_k)
        keys = pl.ds(start, block_k)
        if per_block:  # one scale per query tile and per key tile: one multiply per score
            k0 = ks_ref[start]
            s = _dot_i8(q, k_ref[keys, :]) * (qs_ref[0] * k0)
        else:
            ks = ks_ref[keys]
            s = _dot_i8(q, k_ref[keys, :]) * qs[:, None] * ks[None, :]
        if has_bias:
            s = s + bias_ref[keys][None, :]
        if masked:
            cols = start + jnp.arange(block_k, dtype=jnp.int32)
            s = jnp.where(visible(rows[:, None], cols[None, :], sq_len, sk_len, causal), s, -jnp.inf)
        p = jnp.exp2(s - lse[:, None])
        dp = jnp.dot(do, dequantize_v_t(vt_ref[:, keys], vs, do.dtype), preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None])
        if per_block:
            ds8, ds_scale = int8.quantize_half_even(ds, ds_axes, truncating_convert=True)
            factor = ds_scale * k0 * scale
        else:
            ds8, ds_scale = int8.quantize_half_even(ds * ks[None, :], ds_axes, truncating_convert=True)
            factor = ds_scale * scale
        return acc + _dot_i8(ds8, kt_ref[:, keys]) * factor

    acc = jnp.zeros((block_q, q.shape[-1]), jnp.float32)
    acc = lax.fori_loop(0, n_unmasked, functools.partial(step, masked=False), acc)
    if causal or sk_len % block_k:
        acc = lax.fori_loop(n_unmasked, n_total, functools.partial(step, masked=True), acc)
    store_rows(dq_ref, acc.astype(dq_ref.dtype), q_valid)


# ----------------------------------------------------------------------------- wrapper


def _common(config, sq_len, sk_len, sq_pad, causal, per_block, scale, has_bias):
    # dS: one scale per tile (both axes), or per row of the kernel's tile (its product's output rows)
    ds_axes = 1 if config.ds_scale == "row" else (0, 1)
    return dict(block_q=config.bwd_block_q, block_k=config.bwd_block_k, sq_len=sq_len, sk_len=sk_len, sq_pad=sq_pad,
                causal=causal, per_block=per_block, has_bias=has_bias, scale=scale, ds_axes=ds_axes)


@functools.partial(
    jax.jit, static_argnames=("sq_len", "sk_len", "causal", "per_block", "scale", "config", "interpret")
)
def sage_bwd_dkdv(
    q8, q_scale, q8_t, lse_pad, delta, do, do8_t, do_scale, k8, k_scale, vt8, v_scale, q_mean, bias, *,
    sq_len: int, sk_len: int, causal: bool, per_block: bool, scale: float, config: SageFwdConfig,
    interpret: bool = False,
):
    """dK, dV (B, Sk, Hkv, D) in do's dtype: the Triton dK/dV kernel.

    Args:
      q8, q_scale, q8_t: Q̂ (B, Hq, Sq_pad, D), its scale (incl. scale·log2 e), Q̂ᵀ.
      lse_pad: base-2 LSE (B, Hq, Sq_pad), +inf padded (``sage_tiles.pad_lse``).
      delta, do8_t, do_scale: :func:`sage_bwd_preprocess` of (o, do).
      do: cotangent of o (B, Sq, Hq, D).
      k8, k_scale: K̂ (B, Hkv, Sk_pad, D) and its scale; vt8, v_scale: V̂ᵀ (B, Hkv, D, Sk_pad)
        and the per-channel scale (B, Hkv, D).
      q_mean, bias: Q-smoothing block means (B, Hq, nqb, D) and score bias
        (B, Hq, nqb, Sk_pad), or both None.
    The backward as a whole (preprocess, then this and :func:`sage_bwd_dq` on their
    backends) is ``lowbit_jax.sage._backward_pallas``.
    """
    b, hq, sq_pad, d = q8.shape
    hkv, sk_pad = k8.shape[1], k8.shape[2]
    group = hq // hkv
    bq, bk = config.bwd_block_q, config.bwd_block_k
    nqb, nkb = sq_pad // bq, sk_pad // bk
    q_ratio = config.block_q // bq  # backward query tiles per forward block (bias / q_mean index)
    nqb_fwd = sq_pad // config.block_q
    has_bias = bias is not None
    common = _common(config, sq_len, sk_len, sq_pad, causal, per_block, scale, has_bias)
    grp = lambda *tail: pl.BlockSpec((None, group) + tail, lambda j, bi, hi: (bi, hi) + (0,) * len(tail))  # noqa: E731
    kv_tile = lambda: pl.BlockSpec((None, None, bk, d), lambda j, bi, hi: (bi, hi, j, 0))  # noqa: E731
    kv_tile_t = lambda: pl.BlockSpec((None, None, d, bk), lambda j, bi, hi: (bi, hi, 0, j))  # noqa: E731
    rows_grp = lambda n: pl.BlockSpec((None, n, group, d), lambda j, bi, hi: (bi, 0, hi, 0))  # noqa: E731
    in_specs = [grp(sq_pad, d), grp(sq_pad), grp(d, sq_pad), grp(sq_pad), grp(sq_pad), rows_grp(sq_len),
                grp(d, sq_pad), grp(sq_pad), kv_tile(), pl.BlockSpec((None, None, bk), lambda j, bi, hi: (bi, hi, j)),
                kv_tile_t(), pl.BlockSpec((None, None, d), lambda j, bi, hi: (bi, hi, 0))]
    args = [q8, q_scale, q8_t, lse_pad, delta, do, do8_t, do_scale, k8, k_scale, vt8, v_scale]
    if has_bias:
        in_specs += [grp(nqb_fwd, sk_pad), grp(nqb_fwd, d)]
        args += [bias, q_mean]
    out_spec = pl.BlockSpec((None, bk, None, d), lambda j, bi, hi: (bi, j, hi, 0))
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, group=group, n_qblocks=nqb, q_ratio=q_ratio, sk_pad=sk_pad, **common),
        grid=(nkb, b, hkv),
        in_specs=in_specs,
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((b, sk_len, hkv, d), do.dtype)] * 2,
        compiler_params=compiler_params(config.bwd_warps, config.bwd_stages),
        interpret=interpret,
        name="sage_bwd_dkdv",
    )(*args)


@functools.partial(
    jax.jit, static_argnames=("sq_len", "sk_len", "causal", "per_block", "scale", "config", "interpret")
)
def sage_bwd_dq(
    q8, q_scale, lse_pad, delta, do, k8, k_scale, k8_t, vt8, v_scale, bias, *,
    sq_len: int, sk_len: int, causal: bool, per_block: bool, scale: float, config: SageFwdConfig,
    interpret: bool = False,
):
    """dQ (B, Sq, Hq, D) in do's dtype: the Triton dQ kernel (args as :func:`sage_bwd_dkdv`;
    k8_t is K̂ᵀ (B, Hkv, D, Sk_pad))."""
    b, hq, sq_pad, d = q8.shape
    group = hq // k8.shape[1]
    bq = config.bwd_block_q
    q_ratio = config.block_q // bq
    has_bias = bias is not None
    common = _common(config, sq_len, sk_len, sq_pad, causal, per_block, scale, has_bias)
    q_tile = lambda *tail: pl.BlockSpec((None, None, bq) + tail, lambda i, bi, hi: (bi, hi, i) + (0,) * len(tail))  # noqa: E731
    kv_full = lambda *tail: pl.BlockSpec((None, None) + tail, lambda i, bi, hi: (bi, hi // group) + (0,) * len(tail))  # noqa: E731
    sk_pad = k8.shape[2]
    in_specs = [q_tile(d), q_tile(), q_tile(), q_tile(), pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
                kv_full(sk_pad, d), kv_full(sk_pad), kv_full(d, sk_pad), kv_full(d, sk_pad), kv_full(d)]
    args = [q8, q_scale, lse_pad, delta, do, k8, k_scale, k8_t, vt8, v_scale]
    if has_bias:
        in_specs.append(pl.BlockSpec((None, None, None, sk_pad), lambda i, bi, hi: (bi, hi, i // q_ratio, 0)))
        args.append(bias)
    return pl.pallas_call(
        functools.partial(_dq_kernel, **dict(common, block_k=config.dq_block_k)),
        grid=(sq_pad // bq, b, hq),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bq, None, d), lambda i, bi, hi: (bi, i, hi, 0)),
        out_shape=jax.ShapeDtypeStruct((b, sq_len, hq, d), do.dtype),
        compiler_params=compiler_params(config.dq_warps, config.dq_stages),
        interpret=interpret,
        name="sage_bwd_dq",
    )(*args)
