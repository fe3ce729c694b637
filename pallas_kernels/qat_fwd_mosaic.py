"""Attn-QAT forward (NVFP4 fake-quantized P) in Pallas Mosaic GPU (Hopper).

The numerics of :mod:`pallas_kernels.qat_fwd` (the Triton kernel) and of
``lowbit_jax.qat_reference.qat_forward_reference``: S = Q̃K̃ᵀ·scale·log2 e (16-bit ``wgmma``, fp32 accumulation) on
the fake-quantized operands, online softmax in base 2, P = exp2(S − m) with m the running row max at the tile,
P̃ = FQ(P) in groups of 16 keys per row, O += P̃Ṽ and the high-precision O' += PṼ; l from the unquantized P;
outputs O, O', the base-2 log-sum-exp (+inf for rows that see no key) and the row max m.

FlashAttention-3's shape, as :mod:`pallas_kernels.sage_fwd_mosaic`: grid (query head, 128-query block, batch); a
memory warpgroup streams K̃ and Ṽ tiles through a two-stage TMA pipeline; two compute warpgroups each own 64 query
rows and take turns on the tensor cores (``QatConfig.pingpong``, FlashAttention-3's ping-pong). The O-only forward
(no O′: inference, or a call not differentiated) runs three unscheduled warpgroups at head dim 64, non-causal
(:func:`compute_wgs`), each skipping the key tiles that are nothing to it. P̃ and P are the register A operands of
the two PV products (16-bit, so the accumulator layout converts directly), issued together into the rescaled O and
O' accumulators. O leaves through Q's SMEM tile (Q is not read after the pipeline), so 128-key tiles fit in SMEM
with O'. FQ(P) runs on the accumulator tile with K̃ and Ṽ in lane order (:mod:`pallas_kernels.lane_groups`: each
thread holds whole groups of 16 keys), in packed bf16 arithmetic for bf16 operands, its group scales by
conversion instructions. The softmax scale is folded into the exponent (``exp2(s·c − m)``, one FFMA per score).
Causal (bottom-right aligned, Sq ≤ Sk): the pipeline stops after the last key tile the block sees, the heaviest
blocks launch first; tiles that reach the diagonal or the ragged key tail are masked element-wise, the others
skip the mask.

Not covered (:func:`supports`; the Triton kernel runs instead): head dims other than 64/128, key tiles other than
64/128, Sq_pad not a multiple of 128, fp32 outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.numerics import int8, sage_tiles
from pallas_kernels import lane_groups
from pallas_kernels._mosaic import (
    ForwardLaunch, PingPong, accumulate, compute_pipeline, copy_in, copy_out, forward_cta, guarded_step, launch,
    mask_scores, matmul, needed_step, pad_rows, plgpu, query_ctas, rows_of, schedule_barrier, tile_transforms,
    trim_rows, wg_tiles, wgmma_zeros,
)
from pallas_kernels.configs import QatConfig
from pallas_kernels.register_operands import register_operand

TILE = 64  # query rows per compute warpgroup
STAGES = 2
LOG2E = math.log2(math.e)


def compute_wgs(head_dim: int, causal: bool, with_aux: bool) -> int:
    """Compute warpgroups per CTA (64 query rows each): three for the O-only forward at head dim 64, non-causal
    (the SM then has a third warpgroup's FQ(P) work to issue), else two (with O′'s accumulator three spill
    registers; causal they measured level or slower)."""
    return 3 if head_dim <= 64 and not with_aux and not causal else 2


def supports(*, sq_len: int, sk_len: int, sq_pad: int, head_dim: int, causal: bool, out_dtype,
             config: QatConfig) -> bool:
    """Whether the Mosaic forward covers this call (else the Triton kernel runs)."""
    return (head_dim in (64, 128) and config.block_k in (64, 128) and sq_pad % (2 * TILE) == 0
            and jnp.dtype(out_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and (not causal or sq_len <= sk_len))


def _skipped_step(carry):
    """A step ``_mosaic.needed_step`` rules out: the carry (O's and O′'s accumulators, m, l) as it is."""
    return carry


@dataclasses.dataclass(frozen=True)
class FwdParams(ForwardLaunch):
    """:class:`~pallas_kernels._mosaic.ForwardLaunch` and ``score_scale`` (the softmax scale times log2 e),
    ``with_aux`` (O′ too), ``pingpong``."""

    score_scale: float
    with_aux: bool
    pingpong: bool


def _fwd_kernel(q_ref, k_ref, v_ref, *outs, p: FwdParams, q_tiles, lse, m, barriers, schedule, o2_tiles=None,
                p_tiles=None):
    """``outs``: O, [O′], the LSE, m. The scratch, per compute warpgroup: Q̃'s tile (O goes out through it: Q is not
    read after the pipeline), O′'s with ``with_aux``, the LSE and m on their way out, the barriers, the ping-pong
    barrier; interpreted the two 16-bit A operands (the interpreter takes SMEM operands only)."""
    stages, block_k, head_dim, sq_len, sk_len = p.stages, p.block_k, p.head_dim, p.sq_len, p.sk_len
    causal, offset, score_scale, with_aux, pingpong, wgs, interpret = (p.causal, p.offset, p.score_scale, p.with_aux,
                                                                       p.pingpong, p.wgs, p.interpret)
    q_smem2 = o_smem2 = q_tiles
    o2_smem2, lse_smem2, m_smem2, sched, p_smem = o2_tiles, lse, m, schedule, p_tiles
    o_ref, o2_ref, lse_ref, m_ref = outs if with_aux else (outs[0], None, *outs[1:])
    wg = lax.axis_index("wg")
    shape = (TILE, block_k)
    out_shape = (TILE, head_dim)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    pp = PingPong(sched, wg, pingpong and wgs == 2)
    skips = wgs == 3  # three warpgroups: each skips the key tiles that are empty for its rows

    def kv_spec(dtype):
        return plgpu.BlockSpec((block_k, head_dim), lambda j: (j, 0), transforms=tile_transforms(dtype, head_dim))

    in_specs = [kv_spec(k_ref.dtype), kv_spec(v_ref.dtype)]

    b, h, hkv, q_start, rows, n_steps, masked = forward_cta(p, q_ref.shape[2], k_ref.shape[2], wg, TILE)

    def compute(pipeline):
        copy_in(((q_ref.at[b, h, rows], q_smem2.at[wg]),), barriers, wg)
        zeros = wgmma_zeros(out_shape)
        m = plgpu.layout_cast(jnp.full((TILE,), -jnp.inf, jnp.float32), row_layout)
        l = plgpu.layout_cast(jnp.zeros((TILE,), jnp.float32), row_layout)
        pp.start()
        acc, acc2, m, l = pipeline((zeros, zeros if with_aux else None, m, l))
        pp.finish()
        inv_l = rows_of(int8.reciprocal_or_zero(l), out_shape)
        o_smem, lse_smem, m_smem = o_smem2.at[wg], lse_smem2.at[wg], m_smem2.at[wg]
        o_smem[...] = (acc * inv_l).astype(o_smem.dtype)
        lse_smem[...] = sage_tiles.base2_lse(m, l)
        m_smem[...] = m
        if with_aux:
            o2_smem2.at[wg][...] = (acc2 * inv_l).astype(o_smem.dtype)
        aux = ((o2_smem2.at[wg], o2_ref.at[b, rows, h]),) if with_aux else ()
        copy_out(((o_smem, o_ref.at[b, rows, h]), *aux, (lse_smem, lse_ref.at[b, h, rows]),
                  (m_smem, m_ref.at[b, h, rows])))

    def step(idx, k_smem, v_smem, *consumed_and_carry):
        *consumed, carry = consumed_and_carry
        # a key tile none of this warpgroup's rows sees leaves its carry as it is
        needed = (needed_step(idx[0], q_start, block_k=block_k, sq_len=sq_len, causal=causal, offset=offset)
                  if skips else None)
        return guarded_step(lambda c: attend(idx, k_smem, v_smem, c), carry, consumed, needed=needed,
                            skipped=_skipped_step)

    def attend(idx, k_smem, v_smem, carry):
        acc, acc2, m_prev, l_prev = carry
        s = matmul(shape, jnp.float32, q_smem2.at[wg], k_smem.T, issued=pp.sync)
        if masked:
            s = mask_scores(s, idx[0] * block_k, q_start, causal=causal, offset=offset, sk_len=sk_len,
                            key_of_column=lane_groups.key_of_column)
        # the scale is positive: max(s)·c is the row max of s·c (and −inf stays −inf)
        m_tile = jnp.max(s, axis=1) * score_scale
        m_new = jnp.maximum(m_prev, m_tile)
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        p = jnp.exp2(s * score_scale - rows_of(m_ref, shape))  # one FFMA
        rescale = jnp.exp2(m_prev - m_ref)  # of the running sums, per row
        alpha = rows_of(rescale, out_shape)
        l_new = l_prev * rescale + jnp.sum(p, axis=1)
        dt = v_smem.dtype
        pq = lane_groups.fake_quant_p(p, interpret, dtype=dt, fma=True, fast_scale=True)
        p16 = p.astype(dt) if with_aux else None
        acc, acc2 = acc * alpha, (acc2 * alpha if with_aux else None)
        pq, p16, acc, acc2, l_new = pp.values(pq, p16, acc, acc2, l_new)
        pp.sync()  # the other warpgroup's products run while this one did the element-wise work
        pq = register_operand(pq, p_smem.at[wg, 0] if interpret else None, interpret)
        # accumulate P̃Ṽ (and PṼ) into the rescaled registers, both products issued together
        if with_aux:
            p16 = register_operand(p16, p_smem.at[wg, 1] if interpret else None, interpret)
            acc, acc2 = accumulate((acc, acc2), ((pq, v_smem), (p16, v_smem)), fused=not interpret)
        else:
            (acc,) = accumulate((acc,), ((pq, v_smem),), fused=not interpret)
        return acc, acc2, m_new, l_new

    pipeline = compute_pipeline(step, compute, steps=n_steps, compute_wgs=wgs, stages=stages,
                                in_specs=in_specs)
    pipeline(k_ref.at[b, hkv], v_ref.at[b, hkv])


@functools.partial(
    jax.jit, static_argnames=("sq_len", "sk_len", "causal", "scale", "out_dtype", "config", "with_aux", "lane_ordered",
                              "interpret"))
def qat_attention_fwd_mosaic(qf: jax.Array, kf: jax.Array, vf: jax.Array, *, sq_len: int, sk_len: int, causal: bool,
                             scale: float, out_dtype, config: QatConfig, with_aux: bool = True,
                             lane_ordered: bool = False,
                             interpret: bool = False) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array]:
    """Attn-QAT forward on fake-quantized operands (arguments and results as
    :func:`pallas_kernels.qat_fwd.qat_attention_fwd`).

    Args:
      qf: (B, Hq, Sq_pad, D); kf, vf: (B, Hkv, Sk_pad, D); bf16/fp16, Sq_pad a multiple
        of 128, Sk_pad of ``config.block_k`` (rows beyond the real lengths are ignored).
      sq_len, sk_len: real lengths. causal: bottom-right aligned mask (Sq ≤ Sk).
      scale: softmax scale. out_dtype: bf16/fp16 dtype of O and O'.
      config: ``block_k`` (64 or 128) sets the FP4 groups of P̃ relative to the running max.
      with_aux: also return O'.
      lane_ordered: kf and vf are already in lane order (:mod:`pallas_kernels.lane_groups`: the operand pass
        writes them so); else they are reordered here.
    Returns:
      o (B, Sq, Hq, D), o_aux (same, or None), base-2 lse float32 (B, Hq, Sq) and the
      base-2 row max m float32 (B, Hq, Sq; −inf for rows that see no key).
    """
    b, hq, sq_pad, d = qf.shape
    hkv = kf.shape[1]
    f32 = jnp.float32
    wgs = compute_wgs(d, causal, with_aux)
    rows = query_ctas(sq_pad, sq_len, wgs * TILE, interpret)  # the last CTA may pass Sq_pad: see there
    kernel = functools.partial(_fwd_kernel, p=FwdParams(
        wgs=wgs, stages=STAGES, group=hq // hkv, block_k=config.block_k, head_dim=d, sq_len=sq_len, sk_len=sk_len,
        causal=causal, offset=sk_len - sq_len, score_scale=scale * LOG2E, with_aux=with_aux,
        pingpong=config.pingpong, interpret=interpret))
    if jnp.dtype(out_dtype) != qf.dtype:
        raise ValueError(f"out_dtype must be qf's dtype {qf.dtype} (O reuses Q's SMEM), got {jnp.dtype(out_dtype)}")
    o_tiles = wg_tiles(wgs, TILE, out_dtype, d)  # Q's, then O's; O' has its own (block_k 128 then fits in SMEM)
    scratch = dict(q_tiles=o_tiles, lse=plgpu.SMEM((wgs, TILE), f32), m=plgpu.SMEM((wgs, TILE), f32),
                   barriers=plgpu.Barrier(num_barriers=(1, wgs)), schedule=schedule_barrier())
    if with_aux:
        scratch["o2_tiles"] = o_tiles
    if interpret:
        bk = config.block_k
        scratch["p_tiles"] = plgpu.SMEM((wgs, 2, TILE, bk), qf.dtype, transforms=tile_transforms(qf.dtype, bk))
    if not lane_ordered:
        kf, vf = lane_groups.to_lane_order(kf, 2), lane_groups.to_lane_order(vf, 2)
    qf = pad_rows(qf, rows.q, axis=2)
    o_type = jax.ShapeDtypeStruct((b, rows.o, hq, d), out_dtype)
    row_type = jax.ShapeDtypeStruct((b, hq, rows.row_outputs), f32)
    *outs, lse, m = launch(kernel, [o_type] + ([o_type] if with_aux else []) + [row_type, row_type], scratch,
                           (hq, rows.ctas, b), ("heads", "q", "batch"), name="qat_attention_fwd",
                           compute_wgs=wgs, interpret=interpret)(qf, kf, vf)
    outs = [trim_rows(o, sq_len) for o in outs]
    return outs[0], outs[1] if with_aux else None, trim_rows(lse, sq_len, axis=2), trim_rows(m, sq_len, axis=2)
