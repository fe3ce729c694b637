"""Fused quantize kernels: smoothing + INT8 + head-major / transposed layouts.

Memory-bound: each reads its 16-bit input once and writes int8 codes and
float32 scales. The tile math is :mod:`pallas_kernels.numerics.sage_tiles`, the
same functions the pure-JAX reference runs.

* ``sage_quantize_q``: Q (B, Sq, H, D) → Q̂ (B, H, Sq_pad, D), scale (B, H, Sq_pad)
  [, block means (B, H, Sq_pad/bq, D) with Q-smoothing].
* ``sage_quantize_kv``: K, V (B, Sk, Hkv, D) → K̂ (B, Hkv, Sk_pad, D) after
  K-smoothing, scale (B, Hkv, Sk_pad), V̂ᵀ (B, Hkv, D, Sk_pad).
* ``sage_channel_stats``: what ``sage_quantize_kv`` needs first, K's token mean and V's per-channel
  scale (B, Hkv, D), from one pass over K and V.

Each takes an optional :class:`pallas_kernels.numerics.qk_prologue.QKPrologue`: Q and K then arrive before their
QK-norm and RoPE, which the kernels apply to each loaded tile (:func:`qk_prologue.forward_halves`, on the two
channel halves loaded apart) before quantizing, instead of XLA writing and re-reading a normalized, rotated copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.numerics import e4m3, int8, sage_tiles
from pallas_kernels.numerics.qk_prologue import QKPrologue
from pallas_kernels import qk_prologue as qk_prologue_kernels
from pallas_kernels._triton import compiler_params, load_rows, pl, row_mask
from pallas_kernels.operand_order import check_block, transposed as _transposed

#: at least this many warps for ``sage_quantize_q`` with a prologue (its ALU work; without one the config's are best)
PROLOGUE_WARPS = 8


def _parts(value, fn):
    """``fn`` on a tile or on each of its parts."""
    return tuple(fn(p) for p in value) if isinstance(value, tuple) else fn(value)


def _quantize_q_kernel(x_ref, *refs, seq_len, block, ragged, per_block, smooth_block, out_scale, transposed,
                       t_operand_order, pro):
    refs = list(refs)
    valid = row_mask(pl.program_id(2) * block, block, seq_len)
    x = qk_prologue_kernels.load_tile(x_ref, refs, valid if ragged else None, pro)
    codes_ref, scale_ref = refs.pop(0), refs.pop(0)
    mean_ref = refs.pop(0) if smooth_block else None
    codes_t_ref = refs.pop(0) if transposed else None
    codes, scale, bmean = sage_tiles.quantize_qk_tile(
        x, valid, None, per_block=per_block, smooth_block=smooth_block, out_scale=out_scale
    )
    qk_prologue_kernels.store_parts(codes_ref, codes)
    scale_ref[...] = scale
    if smooth_block:
        qk_prologue_kernels.store_parts(mean_ref, bmean)
    if transposed:
        qk_prologue_kernels.store_parts(codes_t_ref, _parts(codes, lambda c: _transposed(c, t_operand_order)), axis=0)


@functools.partial(
    jax.jit,
    static_argnames=("block", "per_block", "smooth_block", "out_scale", "transposed", "t_operand_order", "num_warps",
                     "interpret"),
)
def sage_quantize_q(
    q: jax.Array,
    prologue: QKPrologue | None = None,
    *,
    block: int,
    per_block: bool,
    smooth_block: bool,
    out_scale: float,
    transposed: bool = False,
    t_operand_order: bool = False,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
    """Quantize Q to INT8, head-major, padded to whole blocks.

    Args:
      q: (B, Sq, H, D) bf16/fp16/fp32 (before QK-norm and RoPE with a prologue).
      prologue: QK-norm and RoPE to apply first (its q side), or None.
      block: rows per program and per quantization block.
      per_block: one scale per block instead of per token.
      smooth_block: subtract each block's mean first (Q-smoothing).
      out_scale: folded into the scale (``softmax_scale · log2 e``).
      transposed: also write Q̂ᵀ (B, H, D, Sq_pad) for the backward's dK = dSᵀQ.
      t_operand_order: Q̂ᵀ's tokens in :mod:`pallas_kernels.operand_order` (what the Mosaic dK/dV kernel
        takes; ``block`` a multiple of 16).
    Returns:
      int8 (B, H, Sq_pad, D), float32 (B, H, Sq_pad), the float32 block
      means (B, H, Sq_pad // block, D) or None, and Q̂ᵀ or None.
    """
    b, s, h, d = q.shape
    if transposed and t_operand_order:
        check_block(block, "block")
    nblk = pl.cdiv(s, block)
    s_pad = nblk * block
    out_shape = [
        jax.ShapeDtypeStruct((b, h, s_pad, d), jnp.int8),
        jax.ShapeDtypeStruct((b, h, s_pad), jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((None, None, block, d), lambda bi, hi, i: (bi, hi, i, 0)),
        pl.BlockSpec((None, None, block), lambda bi, hi, i: (bi, hi, i)),
    ]
    if smooth_block:
        out_shape.append(jax.ShapeDtypeStruct((b, h, nblk, d), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, 1, d), lambda bi, hi, i: (bi, hi, i, 0)))
    if transposed:
        out_shape.append(jax.ShapeDtypeStruct((b, h, d, s_pad), jnp.int8))
        out_specs.append(pl.BlockSpec((None, None, d, block), lambda bi, hi, i: (bi, hi, 0, i)))
    kernel = functools.partial(
        _quantize_q_kernel,
        seq_len=s,
        block=block,
        ragged=s % block != 0,
        per_block=per_block,
        smooth_block=smooth_block,
        out_scale=out_scale,
        transposed=transposed,
        t_operand_order=t_operand_order,
        pro=qk_prologue_kernels.prologue_flags(prologue, interpret),
    )
    pro_args, pro_specs = qk_prologue_kernels.prologue_specs(prologue, "q", block, d, s)
    outs = pl.pallas_call(
        kernel,
        grid=(b, h, nblk),
        in_specs=[pl.BlockSpec((None, block, None, d), lambda bi, hi, i: (bi, i, hi, 0)), *pro_specs],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="sage_quantize_q",
    )(q, *pro_args)
    outs = list(outs)
    q8, qs = outs.pop(0), outs.pop(0)
    q_mean = outs.pop(0) if smooth_block else None
    q8_t = outs.pop(0) if transposed else None
    return q8, qs, q_mean, q8_t


def _quantize_kv_kernel(k_ref, v_ref, *refs, seq_len, block, ragged, per_block, smooth, transposed,
                        v_operand_order, v_format, pro):
    refs = list(refs)
    valid = row_mask(pl.program_id(2) * block, block, seq_len)
    mask = valid if ragged else None
    k = qk_prologue_kernels.load_tile(k_ref, refs, mask, pro)
    kmean = None
    if smooth:
        kmean_ref = refs.pop(0)
        kmean = qk_prologue_kernels.load_halves(kmean_ref, None) if isinstance(k, tuple) else kmean_ref[...]
    vscale_ref, kc_ref, ks_ref, vt_ref = refs[:4]
    kt_ref = refs[4] if transposed else None
    codes, scale, _ = sage_tiles.quantize_qk_tile(
        k, valid, kmean, per_block=per_block, smooth_block=False, out_scale=1.0
    )
    qk_prologue_kernels.store_parts(kc_ref, codes)
    ks_ref[...] = scale
    if transposed:
        qk_prologue_kernels.store_parts(kt_ref, _parts(codes, lambda c: c.T), axis=0)
    v = load_rows(v_ref, mask)
    vt_ref[...] = _transposed(sage_tiles.quantize_v_tile(v, valid, vscale_ref[...], v_format), v_operand_order)


@functools.partial(jax.jit, static_argnames=("block", "per_block", "transposed", "v_operand_order", "v_format",
                                             "num_warps", "interpret"))
def sage_quantize_kv(
    k: jax.Array,
    v: jax.Array,
    k_mean: jax.Array | None,
    v_scale: jax.Array,
    prologue: QKPrologue | None = None,
    *,
    block: int,
    per_block: bool,
    transposed: bool = False,
    v_operand_order: bool = False,
    v_format: str = "int8",
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Quantize K (after smoothing) to INT8 and V (transposed) to INT8 or e4m3 in one pass.

    Args:
      k, v: (B, Sk, Hkv, D) bf16/fp16/fp32 (k before QK-norm and RoPE with a prologue).
      k_mean: float32 (B, Hkv, D) token mean of K (after the prologue), or None for no smoothing.
      v_scale: float32 (B, Hkv, D) per-channel V scale (:func:`sage_channel_stats` with the same ``v_format``).
      block: keys per program and per K quantization block.
      per_block: one K scale per block instead of per token.
      transposed: also write K̂ᵀ (B, Hkv, D, Sk_pad) for the backward's dQ = dS·K.
      v_operand_order: V̂ᵀ's keys in :mod:`pallas_kernels.operand_order` (what the Mosaic forward takes;
        ``block`` a multiple of 16).
      v_format: V̂'s codes, "int8" or "e4m3" (``SageFwdConfig.pv_format``).
      prologue: QK-norm and RoPE to apply to K first (its k side), or None.
    Returns:
      K̂ int8 (B, Hkv, Sk_pad, D), its float32 scale (B, Hkv, Sk_pad),
      V̂ᵀ int8 or float8_e4m3fn (B, Hkv, D, Sk_pad), and K̂ᵀ or None.
    """
    b, s, h, d = k.shape
    if v_operand_order:
        check_block(block, "block")
    nblk = pl.cdiv(s, block)
    s_pad = nblk * block
    row_spec = pl.BlockSpec((None, block, None, d), lambda bi, hi, i: (bi, i, hi, 0))
    head_vec_spec = pl.BlockSpec((None, None, 1, d), lambda bi, hi, i: (bi, hi, 0, 0))
    smooth = k_mean is not None
    pro_args, pro_specs = qk_prologue_kernels.prologue_specs(prologue, "k", block, d, s)
    args = [k, v, *pro_args] + ([k_mean[:, :, None, :]] if smooth else []) + [v_scale[:, :, None, :]]
    in_specs = [row_spec, row_spec, *pro_specs] + [head_vec_spec] * (2 if smooth else 1)
    kernel = functools.partial(
        _quantize_kv_kernel, seq_len=s, block=block, ragged=s % block != 0, per_block=per_block, smooth=smooth,
        transposed=transposed, v_operand_order=v_operand_order, v_format=v_format,
        pro=qk_prologue_kernels.prologue_flags(prologue, interpret),
    )
    out_specs = [
        pl.BlockSpec((None, None, block, d), lambda bi, hi, i: (bi, hi, i, 0)),
        pl.BlockSpec((None, None, block), lambda bi, hi, i: (bi, hi, i)),
        pl.BlockSpec((None, None, d, block), lambda bi, hi, i: (bi, hi, 0, i)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, h, s_pad, d), jnp.int8),
        jax.ShapeDtypeStruct((b, h, s_pad), jnp.float32),
        jax.ShapeDtypeStruct((b, h, d, s_pad), e4m3.DTYPE if v_format == "e4m3" else jnp.int8),
    ]
    if transposed:  # K̂ᵀ: V̂ᵀ's layout, INT8
        out_specs.append(out_specs[2])
        out_shape.append(jax.ShapeDtypeStruct((b, h, d, s_pad), jnp.int8))
    outs = pl.pallas_call(
        kernel,
        grid=(b, h, nblk),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="sage_quantize_kv",
    )(*args)
    return outs[0], outs[1], outs[2], (outs[3] if transposed else None)


#: tokens per program of :func:`sage_channel_stats` and its warps: the fastest measured at small sizes, where XLA's
#: two column reductions are latency-bound (a third of their time); level with them at large sizes
STATS_CHUNK = 256
STATS_WARPS = 4
#: tokens per program with a prologue (its halves and tables in registers)
PROLOGUE_STATS_CHUNK = 128


def _channel_stats_kernel(*refs, chunk, seq_len, ragged, smooth, pro):
    refs = list(refs)
    k_ref = refs.pop(0) if smooth else None
    v_ref = refs.pop(0)  # then the prologue's inputs (with smoothing), then the outputs
    valid = row_mask(pl.program_id(2) * chunk, chunk, seq_len) if ragged else None  # padding rows load as 0
    if smooth:
        k = qk_prologue_kernels.load_tile(k_ref, refs, valid, pro)
    ksum_ref = refs.pop(0) if smooth else None
    vmax_ref = refs.pop(0)
    if smooth:  # padding rows give 0: the prologue maps a zero row to zeros
        qk_prologue_kernels.store_parts(ksum_ref,
                                        _parts(k, lambda t: jnp.sum(t.astype(jnp.float32), axis=0, keepdims=True)))
    vmax_ref[...] = jnp.max(int8.magnitude(load_rows(v_ref, valid).astype(jnp.float32)), axis=0, keepdims=True)


@functools.partial(jax.jit, static_argnames=("smooth_k", "v_format", "chunk", "num_warps", "interpret"))
def sage_channel_stats(
    k: jax.Array,
    v: jax.Array,
    prologue: QKPrologue | None = None,
    *,
    smooth_k: bool,
    v_format: str = "int8",
    chunk: int | None = None,
    num_warps: int = STATS_WARPS,
    interpret: bool = False,
) -> tuple[jax.Array | None, jax.Array]:
    """K's token mean and V's per-channel INT8 scale, the inputs of :func:`sage_quantize_kv`.

    The values of :func:`lowbit_jax.sage_reference.channel_stats` (XLA's column reductions): the V scale
    equal (a maximum does not depend on the order), the K mean to float32 rounding (partial sums per
    ``chunk`` tokens, then summed). One program per (batch, kv head, chunk) writes its partial sum and
    maximum; XLA adds up the few partials. Faster than XLA's two reductions at small sizes, where theirs
    are latency-bound (see ``STATS_CHUNK``).

    Args:
      k, v: (B, Sk, Hkv, D) bf16/fp16/fp32.
      smooth_k: whether K's mean is wanted (K-smoothing); without it K is not read.
      v_format: the format V is quantized to ("int8" or "e4m3"), which sets its scale.
      prologue: QK-norm and RoPE applied to K before its mean (its k side), or None.
      chunk: tokens per program (None: :data:`STATS_CHUNK`, :data:`PROLOGUE_STATS_CHUNK` with a prologue).
    Returns:
      float32 (B, Hkv, D) K mean or None, float32 (B, Hkv, D) V scale (``sage_tiles.v_scale_from_amax`` of
      |V|'s maximum over tokens).
    """
    b, s, h, d = v.shape
    if chunk is None:
        chunk = PROLOGUE_STATS_CHUNK if prologue is not None and smooth_k else STATS_CHUNK
    nch = pl.cdiv(s, chunk)
    row = pl.BlockSpec((None, chunk, None, d), lambda bi, hi, i: (bi, i, hi, 0))
    part = pl.BlockSpec((None, None, 1, d), lambda bi, hi, i: (bi, hi, i, 0))
    n_out = 2 if smooth_k else 1
    pro_args, pro_specs = qk_prologue_kernels.prologue_specs(prologue if smooth_k else None, "k", chunk, d, s)
    outs = pl.pallas_call(
        functools.partial(_channel_stats_kernel, chunk=chunk, seq_len=s, ragged=s % chunk != 0, smooth=smooth_k,
                          pro=qk_prologue_kernels.prologue_flags(prologue if smooth_k else None, interpret)),
        grid=(b, h, nch),
        in_specs=[row, row, *pro_specs] if smooth_k else [row],
        out_specs=[part] * n_out,
        out_shape=[jax.ShapeDtypeStruct((b, h, nch, d), jnp.float32)] * n_out,
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="sage_channel_stats",
    )(*((k, v, *pro_args) if smooth_k else (v,)))
    k_mean = jnp.sum(outs[0], axis=2) / s if smooth_k else None
    return k_mean, sage_tiles.v_scale_from_amax(jnp.max(outs[-1], axis=2), v_format)
