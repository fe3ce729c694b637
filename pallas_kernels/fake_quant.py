"""NVFP4 fake quantization (Attn-QAT's Q, K, V; ThriftAttention's K, V): fused, memory-bound passes.

One pass per tensor (:func:`fp4_fake_quant_heads`), or Attn-QAT's K and V in one launch
(:func:`fp4_fake_quant_kv`).

Reads (B, S, H, D) rows, fake-quantizes each token in groups of 16 channels (or, for ThriftAttention's V,
each channel in groups of 16 tokens) with
:func:`pallas_kernels.numerics.nvfp4.fake_quant_last` (the same function the
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

from pallas_kernels.numerics import nvfp4
from pallas_kernels.numerics.qk_prologue import QKPrologue
from pallas_kernels import lane_groups
from pallas_kernels import qk_prologue as qk_prologue_kernels
from pallas_kernels._triton import compiler_params, pl, row_mask


#: at least this many warps for a fake quantization with a prologue from head dim 128 (its ALU work); without a
#: prologue, or at head dim 64, the config's warps are as fast
PROLOGUE_WARPS_WIDE = 8


def warps_for(num_warps: int, head_dim: int, prologue: QKPrologue | None) -> int:
    """The warps of :func:`fp4_fake_quant_heads` given a config's ``num_warps`` (:data:`PROLOGUE_WARPS_WIDE`)."""
    return max(num_warps, PROLOGUE_WARPS_WIDE) if prologue is not None and head_dim >= 128 else num_warps


def _fake_quant_kernel(*refs, n, block, seq_len, ragged, along, lane_order, pro):
    """``refs``: n inputs, the first one's prologue refs, n outputs; the prologue applies to the first only."""
    x_refs, refs = refs[:n], list(refs[n:])
    valid = row_mask(pl.program_id(0) * block, block, seq_len) if ragged else None
    # with a prologue: its two channel halves
    xs = [qk_prologue_kernels.load_tile(x_ref, refs, valid, pro if i == 0 else qk_prologue_kernels.Flags())
          for i, x_ref in enumerate(x_refs)]
    # lane order: key k of the block is stored at its lane-order row column_of_key(k) (a row scatter within the
    # block, cheaper than permuting the tile's rows in registers)
    rows = lane_groups.column_of_key(jnp.arange(block, dtype=jnp.int32)) if lane_order else None

    def quantize(t):  # every output has the one out_dtype
        t = t.astype(jnp.float32)
        if along == "channels":
            fq = nvfp4.fake_quant_last(t)
        else:  # groups of 16 tokens per channel: the same quantizer on the transposed tile
            fq = nvfp4.fake_quant_last(t.T).T
        return fq.astype(refs[0].dtype)

    for x, o_ref in zip(xs, refs, strict=True):
        # groups of 16 channels never straddle the halves (D/2 is a multiple of 16)
        qk_prologue_kernels.store_parts(o_ref, tuple(map(quantize, x)) if isinstance(x, tuple) else quantize(x),
                                        rows=rows)


def _check(block: int, along: str, lane_order: bool, which: str, prologue: QKPrologue | None) -> None:
    if along not in ("channels", "tokens"):
        raise ValueError(f"along must be 'channels' or 'tokens', got {along!r}")
    if lane_order and block % lane_groups.BLOCK:
        raise ValueError(f"lane_order needs block a multiple of {lane_groups.BLOCK}, got {block}")
    if which not in ("q", "k"):
        raise ValueError(f"which must be 'q' or 'k' (the prologue's side), got {which!r}")
    if prologue is not None and along != "channels":
        raise ValueError("a prologue needs along='channels' (it normalizes and rotates each token's channels)")


def _call(xs: tuple[jax.Array, ...], prologue: QKPrologue | None, which: str, *, seq_pad: int, block: int, out_dtype,
          along: str, lane_order: bool, num_warps: int, interpret: bool) -> list[jax.Array]:
    """One launch over the (row block, batch, head) tiles of equally shaped ``xs``: FQ of each."""
    _check(block, along, lane_order, which, prologue)
    b, s, h, d = xs[0].shape
    kernel = functools.partial(_fake_quant_kernel, n=len(xs), block=block, seq_len=s, ragged=seq_pad != s,
                               along=along, lane_order=lane_order,
                               pro=qk_prologue_kernels.prologue_flags(prologue, interpret))
    pro_args, pro_specs = qk_prologue_kernels.prologue_specs(prologue, which, block, d, s,
                                                             row_block=lambda i, bi, hi: i)
    in_spec = pl.BlockSpec((None, block, None, d), lambda i, bi, hi: (bi, i, hi, 0))
    out_spec = pl.BlockSpec((None, None, block, d), lambda i, bi, hi: (bi, hi, i, 0))
    return pl.pallas_call(
        kernel,
        grid=(seq_pad // block, b, h),
        in_specs=[in_spec] * len(xs) + pro_specs,
        out_specs=[out_spec] * len(xs),
        out_shape=[jax.ShapeDtypeStruct((b, h, seq_pad, d), out_dtype)] * len(xs),
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="fp4_fake_quant",
    )(*xs, *pro_args)


_STATIC = ("which", "seq_pad", "block", "out_dtype", "along", "lane_order", "num_warps", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def fp4_fake_quant_heads(x: jax.Array, prologue: QKPrologue | None = None, which: str = "q", *, seq_pad: int,
                         block: int, out_dtype, along: str = "channels", lane_order: bool = False, num_warps: int = 4,
                         interpret: bool = False) -> jax.Array:
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
      prologue, which: QK-norm and/or RoPE (``prologue``'s ``which`` side, "q" or "k") applied to each loaded tile
        before it is quantized (x is then the pre-norm q or k; ``along="channels"`` only): the values of
        FQ(``qk_prologue.apply(x, …)``).
    Returns:
      (B, H, seq_pad, D) out_dtype; rows ≥ S are zeros.
    """
    return _call((x,), prologue, which, seq_pad=seq_pad, block=block, out_dtype=out_dtype, along=along,
                 lane_order=lane_order, num_warps=num_warps, interpret=interpret)[0]


@functools.partial(jax.jit, static_argnames=_STATIC[1:])
def fp4_fake_quant_kv(k: jax.Array, v: jax.Array, prologue: QKPrologue | None = None, *, seq_pad: int, block: int,
                      out_dtype, along: str = "channels", lane_order: bool = False, num_warps: int = 4,
                      interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(FQ(k), FQ(v)) by one launch: each as :func:`fp4_fake_quant_heads` would give it, ``prologue``'s "k" side
    applied to k only. k, v: (B, S, H, D) of one shape and dtype."""
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k and v must match in shape and dtype, got {k.shape} {k.dtype} and {v.shape} {v.dtype}")
    kf, vf = _call((k, v), prologue, "k", seq_pad=seq_pad, block=block, out_dtype=out_dtype, along=along,
                   lane_order=lane_order, num_warps=num_warps, interpret=interpret)
    return kf, vf
