"""NVFP4 fake quantization (Attn-QAT's Q, K, V; ThriftAttention's K, V): one fused, memory-bound pass per tensor.

Reads (B, S, H, D) rows, fake-quantizes each token in groups of 16 channels (or, for ThriftAttention's V,
each channel in groups of 16 tokens) with
:func:`lowbit_jax.formats.nvfp4.fake_quant_last` (the same function the
reference uses) and writes the values head-major and zero-padded,
(B, H, S_pad, D), in the 16-bit operand dtype of the attention kernels (exact:
e2m1 · e4m3 fits bf16 and fp16).

Doing this once per tensor instead of inside the attention kernels saves the
attention kernel from re-quantizing every K/V tile once per query tile
(2·D/block_q times the FP4 work of P). The outputs double as the backward's
residuals (the same bytes as a 16-bit flash attention keeps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lowbit_jax.formats import nvfp4
from pallas_kernels import lane_groups
from pallas_kernels._triton import compiler_params, load_rows, pl, row_mask


def _fake_quant_kernel(x_ref, o_ref, *, block, seq_len, ragged, along, lane_order):
    valid = row_mask(pl.program_id(0) * block, block, seq_len) if ragged else None
    x = load_rows(x_ref, valid).astype(jnp.float32)
    if along == "channels":
        fq = nvfp4.fake_quant_last(x)
    else:  # groups of 16 tokens per channel: the same quantizer on the transposed tile
        fq = nvfp4.fake_quant_last(x.T).T
    if lane_order:
        fq = lane_groups.to_lane_order(fq, 0)
    o_ref[...] = fq.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("seq_pad", "block", "out_dtype", "along", "lane_order", "num_warps",
                                             "interpret"))
def fp4_fake_quant_heads(x: jax.Array, *, seq_pad: int, block: int, out_dtype, along: str = "channels",
                         lane_order: bool = False, num_warps: int = 4, interpret: bool = False) -> jax.Array:
    """FQ(x), transposed to head-major and padded.

    Args:
      x: (B, S, H, D), D a multiple of 16.
      seq_pad: padded length, a multiple of ``block`` (itself a multiple of 16) and ≥ S.
      out_dtype: bfloat16 or float16.
      along: "channels" (groups of 16 along D, per token: Attn-QAT's Q, K, V, ThriftAttention's K) or
        "tokens" (16 consecutive tokens per channel, aligned to absolute positions: ThriftAttention's V,
        whose product with P contracts over tokens; :func:`lowbit_jax.thrift_reference.fake_quant_operand`
        is that twin).
      lane_order: write the rows of every 64-row block in the Mosaic Attn-QAT kernels' lane order
        (:func:`pallas_kernels.lane_groups.to_lane_order`; ``block`` a multiple of 64).
    Returns:
      (B, H, seq_pad, D) out_dtype; rows ≥ S are zeros.
    """
    if along not in ("channels", "tokens"):
        raise ValueError(f"along must be 'channels' or 'tokens', got {along!r}")
    if lane_order and block % lane_groups.BLOCK:
        raise ValueError(f"lane_order needs block a multiple of {lane_groups.BLOCK}, got {block}")
    b, s, h, d = x.shape
    kernel = functools.partial(_fake_quant_kernel, block=block, seq_len=s, ragged=seq_pad != s, along=along,
                               lane_order=lane_order)
    return pl.pallas_call(
        kernel,
        grid=(seq_pad // block, b, h),
        in_specs=[pl.BlockSpec((None, block, None, d), lambda i, bi, hi: (bi, i, hi, 0))],
        out_specs=pl.BlockSpec((None, None, block, d), lambda i, bi, hi: (bi, hi, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, h, seq_pad, d), out_dtype),
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="fp4_fake_quant",
    )(x)
