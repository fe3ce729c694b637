"""INT8 flash-attention forward (SageAttention) in Pallas Mosaic GPU (Hopper).

The numerics of :mod:`pallas_kernels.sage_fwd` (the Triton kernel) and of the pure-JAX reference: S =
Q̂K̂ᵀ·s_Q·s_K in base 2, online softmax, P̃ = exp2(S − rowmax of the tile) quantized to INT8 per row (the row max
maps to 127), O accumulates int32(P̂V̂)·β/127 with β = exp2(m_tile − m_ref), s_V applied per channel at the end, l
from the unquantized P̃, and the base-2 log-sum-exp (+inf for rows that see no key).

FlashAttention-3's shape: grid (query head, query block, batch); a memory warpgroup streams K̂ (block_k, D), its
scales and V̂ᵀ (D, block_k) through a two-stage TMA pipeline; compute warpgroups each own 64 query rows: two per
CTA taking turns on the tensor cores at head dim 128 (FlashAttention-3's ping-pong: one's softmax runs while the
other's products do), three unscheduled at 64 (FlashAttention-3's 192-row tile, :func:`compute_wgs`). Both
products are INT8 ``wgmma`` with K-major operands (B = a transposed view of K̂ or V̂ᵀ); P̂ is the A operand straight
from registers: V̂ᵀ's keys come in :mod:`pallas_kernels.operand_order` (written so by ``sage_quantize_kv``), so
P̂'s registers are the operand as they are, no lane shuffle and no SMEM round trip. With per-block scales the
scores stay unscaled through the row maximum and the scale is folded into the exponent (``exp2(s·c − m)``, one
FFMA per score).

Causal (bottom-right aligned, Sq ≤ Sk): the pipeline stops after the last key tile the block's last row sees,
the heaviest query blocks launch first (the longest CTAs do not trail the grid); tiles that reach the diagonal or
the ragged key tail are masked element-wise, the others skip the mask. With three warpgroups, a warpgroup also
skips the tiles past its own last row's diagonal and, in the last CTA, every tile if its rows are all padding.
Causal at head dim 64, O and l are rescaled only when a row max grows past its reference by 2^8
(FlashAttention-4's conditional rescaling, :func:`rescales_lazily`).

With e4m3 V̂ᵀ (``SageFwdConfig.pv_format``) P·V is an FP8 ``wgmma`` instead (:func:`_attend_e4m3`): P̃ at the
running max, no int32 → float conversion and no rescale of the product, each tile's product added to O in float32.

Not covered (:func:`supports`; the Triton kernel runs instead): Q-smoothing bias, head dims other than 64/128, key
tiles other than 64/128, Sq_pad not a multiple of 128.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.numerics import e4m3, int8, sage_tiles
from pallas_kernels import operand_order
from pallas_kernels._mosaic import (
    ForwardLaunch, PingPong, col_vector, cols_of, compute_pipeline, copy_in, copy_out, forward_cta, guarded_step,
    key_step_specs, launch, mask_scores, matmul, needed_step, pad_rows, plgpu, query_ctas, row_vector, rows_of, scalar,
    schedule_barrier, transposed_step_spec, trim_rows, wg_tiles, wgmma_zeros,
)
from pallas_kernels.configs import SageFwdConfig
from pallas_kernels.register_operands import int8_operand_in_smem, register_operand
from pallas_kernels.warp_reduce import warp_any_above

TILE = 64  # query rows per compute warpgroup
STAGES = 2
#: the smallest scale product used: a positive normal float, so a masked −inf score stays −inf when scaled
MIN_SCALE = float(jnp.finfo(jnp.float32).tiny)
#: how far (base 2) the reference max of O and l may trail the running row max before they are rescaled
LAZY_RESCALE_BITS = 8.0


def rescales_lazily(head_dim: int, causal: bool) -> bool:
    """Whether the forward rescales O and l only when a row max passes its reference by more than
    :data:`LAZY_RESCALE_BITS`: causal at head dim 64, where it measured faster (elsewhere the vote and branch cost
    more than the multiplies they save)."""
    return causal and head_dim <= 64


def compute_wgs(head_dim: int) -> int:
    """Compute warpgroups per CTA (64 query rows each): three at head dim 64 (each SM then has a third
    warpgroup's softmax to issue), two with ping-pong at 128 (three would spill registers)."""
    return 3 if head_dim <= 64 else 2


def takes_operand_order(interpret: bool) -> bool:
    """Whether this kernel should be given V̂ᵀ in operand order (``operand_order.available``)."""
    return operand_order.available(interpret)


def supports(*, sq_len: int, sk_len: int, sq_pad: int, head_dim: int, causal: bool, has_bias: bool,
             config: SageFwdConfig) -> bool:
    """Whether the Mosaic forward covers this call (else the Triton kernel runs)."""
    return (not has_bias and head_dim in (64, 128) and config.block_k in (64, 128) and sq_pad % (2 * TILE) == 0
            and (not causal or sq_len <= sk_len))


def _skipped_step(carry):
    """A step ``_mosaic.needed_step`` rules out: the carry (O's accumulator, m, l) as it is."""
    return carry


@dataclasses.dataclass(frozen=True)
class FwdParams(ForwardLaunch):
    """:class:`~pallas_kernels._mosaic.ForwardLaunch` and ``scalar_scales`` (per-block Q/K scales read as one scalar
    per step), ``operand`` (V̂ᵀ's keys in :mod:`pallas_kernels.operand_order`), ``e4m3`` (V̂ᵀ holds e4m3 codes:
    the FP8 P·V of :func:`_attend_e4m3`)."""

    scalar_scales: bool
    operand: bool
    e4m3: bool = False


def _fwd_kernel(q_ref, qs_ref, k_ref, ks_ref, vt_ref, vs_ref, o_ref, lse_ref, *, p: FwdParams, q_tiles, q_scales,
                v_scales, o_tiles, lse, barriers, schedule, p_tiles=None):
    """The scratch, per compute warpgroup: Q̂ and its scales, V's channel scales, O and the LSE on their way out, the
    barriers, the ping-pong barrier; P̂ only where it goes through SMEM (``register_operands.int8_operand_in_smem``)."""
    q_smem2, qs_smem2, vs_smem2, p_smem2, o_smem2, lse_smem2, sched = (q_tiles, q_scales, v_scales, p_tiles,
                                                                        o_tiles, lse, schedule)
    stages, block_k, head_dim, sq_len, sk_len = p.stages, p.block_k, p.head_dim, p.sq_len, p.sk_len
    causal, offset, scalar_scales, operand, wgs, interpret = (p.causal, p.offset, p.scalar_scales, p.operand, p.wgs,
                                                              p.interpret)
    wg = lax.axis_index("wg")
    shape = (TILE, block_k)
    pp = PingPong(sched, wg, wgs == 2)
    skips = not pp.enabled  # three warpgroups: each skips the steps that are empty for its rows
    lazy = rescales_lazily(head_dim, causal) and not p.e4m3  # e4m3 codes need P̃ ≤ 1 at the reference max
    in_specs = [*key_step_specs(block_k, head_dim), transposed_step_spec(block_k, head_dim)]

    b, h, hkv, q_start, rows, n_steps, masked = forward_cta(p, q_ref.shape[2], k_ref.shape[2], wg, TILE)

    def compute(pipeline):
        copies = ((q_ref.at[b, h, rows], q_smem2.at[wg]), (qs_ref.at[b, h, rows], qs_smem2.at[wg]),
                  (vs_ref.at[b, hkv], vs_smem2.at[wg]))
        copy_in(copies, barriers, wg)
        acc = wgmma_zeros((TILE, head_dim))
        m = plgpu.layout_cast(jnp.full((TILE,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((TILE,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        pp.start()
        acc, m, l = pipeline((acc, m, l))
        pp.finish()
        o = acc * rows_of(int8.reciprocal_or_zero(l), acc.shape) * cols_of(col_vector(vs_smem2.at[wg]), acc.shape)
        o_smem, lse_smem = o_smem2.at[wg], lse_smem2.at[wg]
        o_smem[...] = o.astype(o_smem.dtype)
        lse_smem[...] = sage_tiles.base2_lse(m - e4m3.LOG2_MAX if p.e4m3 else m, l)  # l sums P̃·448 with e4m3
        copy_out(((o_smem, o_ref.at[b, rows, h]), (lse_smem, lse_ref.at[b, h, rows])))

    def step(idx, k_smem, ks_smem, vt_smem, *consumed_and_carry):
        *consumed, carry = consumed_and_carry
        # an empty step leaves the carry as it is
        needed = (needed_step(idx[0], q_start, block_k=block_k, sq_len=sq_len, causal=causal, offset=offset)
                  if skips else None)
        return guarded_step(lambda c: attend(idx, k_smem, ks_smem, vt_smem, c), carry, consumed, needed=needed,
                            skipped=_skipped_step)

    def attend(idx, k_smem, ks_smem, vt_smem, carry):
        acc, m_prev, l_prev = carry
        s = matmul(shape, jnp.int32, q_smem2.at[wg], k_smem.T, issued=pp.sync).astype(jnp.float32)
        c = None  # the scores' scale where it is folded into the exponent
        if scalar_scales:  # s stays in units of c > 0: max(s)·c is the row max of s·c
            c = scalar(qs_smem2.at[wg]) * scalar(ks_smem)
            c = jnp.where(c < MIN_SCALE, MIN_SCALE, c)  # not jnp.maximum: the GPU's max drops a NaN scale
        else:
            s = s * rows_of(row_vector(qs_smem2.at[wg]), shape) * cols_of(col_vector(ks_smem), shape)
        if masked:
            s = mask_scores(s, idx[0] * block_k, q_start, causal=causal, offset=offset, sk_len=sk_len)
        m_cur = jnp.max(s, axis=1)
        if c is not None:
            m_cur = m_cur * c
        if p.e4m3:
            return _attend_e4m3(s, c, m_cur, carry, vt_smem, p_smem2, wg, operand, pp, masked, interpret)
        m_ref = jnp.where(m_cur == -jnp.inf, 0.0, m_cur) if masked else m_cur
        e = jnp.exp2((s if c is None else s * c) - rows_of(m_ref, shape))  # s·c − m: one FFMA
        out_shape = (TILE, head_dim)

        def rescaled(state):  # O and l moved to the reference max max(m_prev, m_cur)
            acc, m_prev, l_prev = state
            m_new = jnp.maximum(m_prev, m_cur)
            alpha = jnp.exp2(m_prev - (jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new))
            return acc * rows_of(alpha, out_shape), m_new, l_prev * alpha

        if lazy:  # m_prev is the reference max of acc and l, not the running max
            acc, m_new, l_prev = lax.cond(warp_any_above(m_cur - m_prev, LAZY_RESCALE_BITS, interpret), rescaled,
                                          lambda state: state, (acc, m_prev, l_prev))
        else:
            acc, m_new, l_prev = rescaled((acc, m_prev, l_prev))
        m_new_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        beta = jnp.exp2(m_cur - m_new_ref)  # the row max of this tile's P̃ (≤ 2^LAZY_RESCALE_BITS)
        l_new = l_prev + beta * jnp.sum(e, axis=1)
        if c is not None:  # a non-finite scale makes l NaN: the signs of the scores alone could leave a row looking
            l_new = l_new + (c - c)  # masked (max −inf, l 0, O 0), as a NaN in K did when its codes shared one sign
        p_smem = None if p_smem2 is None else p_smem2.at[wg]
        p8 = int8.encode_unit_interval(e, truncating_convert=True)
        p8 = (operand_order.register_operand if operand else register_operand)(p8, p_smem, interpret)
        if p_smem is not None:  # stored to SMEM: nothing in registers to hold back
            acc, l_new = pp.values(acc, l_new)
        else:
            p8, acc, l_new = pp.values(p8, acc, l_new)
        pp.sync()  # the other warpgroup's products ran while this one did the element-wise work
        pv = matmul(out_shape, jnp.int32, p8, vt_smem.T).astype(jnp.float32)
        acc = acc + pv * rows_of(beta * (1.0 / int8.QMAX), out_shape)
        return acc, m_new, l_new

    pipeline = compute_pipeline(step, compute, steps=n_steps, compute_wgs=wgs, stages=stages,
                                in_specs=in_specs)
    pipeline(k_ref.at[b, hkv], ks_ref.at[b, hkv], vt_ref.at[b, hkv])


def _attend_e4m3(s, c, m_cur, carry, vt_smem, p_smem2, wg, operand, pp, masked, interpret):
    """The rest of a key step with e4m3 P·V (``FwdParams.e4m3``): P̃ at the running row max as e4m3 codes of
    P̃·448, the tile's FP8 product summed in float32 by the tensor cores and added to O (two-level accumulation:
    Hopper's FP8 ``wgmma`` keeps fewer accumulator bits than float32, which O carried in it across tiles loses)."""
    acc, m_prev, l_prev = carry
    m_new = jnp.maximum(m_prev, m_cur)
    m_new_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    alpha = jnp.exp2(m_prev - m_new_ref)
    m_e = m_new_ref - e4m3.LOG2_MAX
    e = jnp.exp2((s if c is None else s * c) - rows_of(m_e, s.shape))  # s·c − m: one FFMA; P̃·448 ∈ [0, 448]
    l_new = l_prev * alpha + jnp.sum(e, axis=1)
    if c is not None:  # a non-finite scale makes the row NaN (see attend)
        l_new = l_new + (c - c)
    p_smem = None if p_smem2 is None else p_smem2.at[wg]
    p8 = e4m3.encode_probabilities(e)
    p8 = (operand_order.register_operand if operand else register_operand)(p8, p_smem, interpret)
    if p_smem is not None:
        acc, alpha, l_new = pp.values(acc, alpha, l_new)
    else:
        p8, acc, alpha, l_new = pp.values(p8, acc, alpha, l_new)
    pp.sync()
    pv = matmul(acc.shape, jnp.float32, p8, vt_smem.T)
    return acc * rows_of(alpha, acc.shape) + pv, m_new, l_new


@functools.partial(jax.jit, static_argnames=("sq_len", "sk_len", "causal", "out_dtype", "config", "per_block",
                                             "v_operand_order", "interpret"))
def sage_attention_fwd_mosaic(
    q8: jax.Array, q_scale: jax.Array, k8: jax.Array, k_scale: jax.Array, vt8: jax.Array, v_scale: jax.Array, *,
    sq_len: int, sk_len: int, causal: bool, out_dtype: jnp.dtype, config: SageFwdConfig, per_block: bool = False,
    v_operand_order: bool = False, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """INT8 attention forward on quantized operands (arguments as ``sage_fwd.sage_attention_fwd``, no bias).

    Args:
      q8: int8 (B, Hq, Sq_pad, D); q_scale float32 (B, Hq, Sq_pad) incl. scale·log2 e.
      k8: int8 (B, Hkv, Sk_pad, D); k_scale float32 (B, Hkv, Sk_pad).
      vt8: int8 or float8_e4m3fn (B, Hkv, D, Sk_pad) (e4m3: FP8 P·V, :func:`_attend_e4m3`); v_scale float32
        (B, Hkv, D).
      sq_len, sk_len, causal: real lengths and the bottom-right aligned causal mask.
      out_dtype: dtype of o (bf16/fp16/fp32).
      config: ``block_k`` is the P quantization tile (64 or 128).
      per_block: the Q and K scales are per block (``config.block_q``, ``config.block_k``): equal within each
        64-row tile and each key step, so the scores take one scalar product per step (two ``_mosaic.scalar``
        reads) instead of a row and a column broadcast.
      v_operand_order: vt8's keys are in :mod:`pallas_kernels.operand_order` (``sage_quantize_kv``'s
        ``v_operand_order``): P̂ is then PV's A operand as the registers hold it, no lane shuffles. Only where
        :func:`takes_operand_order`.
    Returns:
      o (B, Sq, Hq, D) out_dtype and the base-2 LSE float32 (B, Hq, Sq).
    """
    b, hq, sq_pad, d = q8.shape
    hkv = k8.shape[1]
    f32 = jnp.float32
    if v_operand_order and not takes_operand_order(interpret):
        raise ValueError("v_operand_order: this kernel takes V̂ᵀ in operand order only where takes_operand_order()")
    wgs = compute_wgs(d)
    rows = query_ctas(sq_pad, sq_len, wgs * TILE, interpret)  # the last CTA may pass Sq_pad: see there
    params = FwdParams(wgs=wgs, stages=STAGES, group=hq // hkv, block_k=config.block_k, head_dim=d, sq_len=sq_len,
                       sk_len=sk_len, causal=causal, offset=sk_len - sq_len,
                       scalar_scales=per_block and config.block_q % TILE == 0, operand=v_operand_order,
                       interpret=interpret, e4m3=vt8.dtype == e4m3.DTYPE)
    kernel = functools.partial(_fwd_kernel, p=params)
    scratch = dict(q_tiles=wg_tiles(wgs, TILE, jnp.int8, d), q_scales=plgpu.SMEM((wgs, TILE), f32),
                   v_scales=plgpu.SMEM((wgs, d), f32), o_tiles=plgpu.SMEM((wgs, TILE, d), out_dtype),
                   lse=plgpu.SMEM((wgs, TILE), f32), barriers=plgpu.Barrier(num_barriers=(3, wgs)),
                   schedule=schedule_barrier())
    if int8_operand_in_smem(interpret):
        scratch["p_tiles"] = wg_tiles(wgs, TILE, vt8.dtype, config.block_k)
    q8, q_scale = pad_rows(q8, rows.q, axis=2), pad_rows(q_scale, rows.q, axis=2)
    out_type = [jax.ShapeDtypeStruct((b, rows.o, hq, d), out_dtype),
                jax.ShapeDtypeStruct((b, hq, rows.row_outputs), f32)]
    o, lse = launch(kernel, out_type, scratch, (hq, rows.ctas, b), ("heads", "q", "batch"),
                    name="sage_attention_fwd", compute_wgs=wgs,
                    interpret=interpret)(q8, q_scale, k8, k_scale, vt8, v_scale)
    return trim_rows(o, sq_len), trim_rows(lse, sq_len, axis=2)
