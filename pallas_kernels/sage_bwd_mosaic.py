"""SageBwd on Hopper: the INT8 attention backward in Pallas Mosaic GPU.

The numerics of :mod:`pallas_kernels.sage_bwd` (the Triton kernels) and of the pure-JAX reference: the same
residuals, the same per-tile dS quantization, the same P quantization per key row; only the execution differs.
Each kernel is warp-specialised: a memory warpgroup streams tiles with TMA into an SMEM pipeline while two compute
warpgroups each own one 64-row tile and issue ``wgmma`` (INT8×INT8→INT32 for QKᵀ, dV, dK and dQ; 16-bit only
for dP).

* ``sage_bwd_dkdv_mosaic`` — grid (kv head, 128-key block, batch); each compute warpgroup holds a 64-key tile of
  K̂ and Ṽ and loops over every query tile of every query head of its GQA group: Sᵀ = K̂Q̂ᵀ, Pᵀ = exp2(Sᵀ − L),
  dV += P̂ᵀdÔ, dPᵀ = ṼdOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D), dK += dŜᵀQ̂.
* with dQ fused in (``k8_t=``, ``SageFwdConfig.dq_kernel``, the default): the per-tile dŜ is also stored
  transposed and each step's dŜK̂ is reduce-added by TMA into a float32 dQ (FlashAttention-3's accumulation,
  :mod:`pallas_kernels.reduce_add`). K̂ and Ṽ rows come in :mod:`pallas_kernels.key_pairs` order, so the
  transposed copy is two ``stmatrix.trans`` per thread and step; dK and dV leave in natural order. At head dim 128
  the two warpgroups split dQ by columns (:func:`_split_dq`): after a barrier that exchanges their dŜ tiles, each
  reduce-adds one 64-column half over the CTA's 128 keys (half the float32 traffic of one 64 × 128 tile per
  warpgroup, which was most of dQ's cost), after dK's product or before it with its stage store and reduce-add
  issued while dK's runs (``SageFwdConfig.split_dq_schedule``); at 64 the stage holds its columns permuted
  (:mod:`pallas_kernels.dq_stage`: conflict-free 16-byte stores).
* ``sage_bwd_dq_mosaic`` — the separate dQ kernel (``dq_kernel="separate"``, and per-token scales): grid (query
  head, 128-query block, batch); each compute warpgroup holds a 64-query tile and loops over the 64-key tiles.

The INT8 A operands P̂ᵀ and dŜᵀ (dK/dV kernel) and dŜ (dQ kernel) are taken straight from registers: the dK/dV
kernel gets Q̂ᵀ and dÔᵀ with their queries in :mod:`pallas_kernels.operand_order`, so the registers are the
operands as they are; elsewhere ``register_operands.register_operand`` relays them out by lane shuffles. The
fused dQ's dŜ (queries × keys) is a transposed copy and always goes through SMEM. Independent products are issued
before one wait: Sᵀ with dPᵀ, and at head dim 64 dV with dK (causal, with the fused dQ, dQ's product as well);
at 128 dV and dK are waited for one at a time, since two (64 × 128) INT32 products beside the dK and dV
accumulators would exceed the compute warpgroups' registers. The Mosaic GPU interpreter runs the products one at
a time (same values).

Causal (bottom-right aligned, Sq ≤ Sk): the dK/dV kernel starts at the first query tile that sees its keys and
the dQ kernel stops after the last key tile its queries see; tiles that reach the diagonal are masked
element-wise before their scale is applied (so the scale and the exponent's − L contract into one FFMA), the
others skip the mask (``_mosaic.mask_scores``).

Covered (:func:`supports`): no Q-smoothing, head dim 64 or 128, 64×64 backward tiles, no key padding; elsewhere
the Triton kernels run. The preprocess (D, INT8 dOᵀ) is the Triton one.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.numerics import int8
from pallas_kernels.numerics.sage_tiles import dequantize_v_t
from pallas_kernels import dq_stage, key_pairs, operand_order
from pallas_kernels._mosaic import (
    col_vector, cols_of, compute_pipeline, copy_in, copy_out, first_query_tile, grid_position, group_tile,
    guarded_step, key_step_specs, launch, mask_scores, matmul, matmuls, pad_rows, pl, plgpu, query_block_keys,
    row_vector, rows_of, scalar, tile_transforms, tma_rows, transposed_step_spec, trim_rows, wg_tiles, wgmma_zeros,
)
from pallas_kernels.configs import SPLIT_DQ_SCHEDULES, SageFwdConfig
from pallas_kernels.reduce_add import (
    REDUCE_COLS, early_stage_wait, reduce_add_accumulator, reduce_add_matmul, reduce_add_product, reduce_add_slot,
    reduce_add_stage, reduce_add_total,
)
from pallas_kernels.register_operands import int8_operand_in_smem, register_operand
from pallas_kernels.warp_reduce import tile_absmax, tile_absmax_of

LOG2E = math.log2(math.e)
TILE = 64  # rows per compute warpgroup, and the pipelined tile
WGS = 2  # compute warpgroups per CTA
STAGES = 2


def _dkdv_stages(head_dim: int) -> int:
    """Pipeline stages of the dK/dV kernel's query tiles: three at head dim 64, where SMEM has room for them."""
    return 3 if head_dim <= 64 else STAGES


def _smem_operands(interpret: bool) -> bool:
    """Whether P̂ᵀ and dŜ (the INT8 A operands of dV, dK and the dQ kernel's dŜK̂) need SMEM tiles: not where
    ``register_operands.register_operand`` takes them from registers (compiled, with the relayout available)."""
    return int8_operand_in_smem(interpret)


def takes_operand_order(interpret: bool) -> bool:
    """Whether the dK/dV kernel should be given Q̂ᵀ and dÔᵀ in operand order (``operand_order.available``)."""
    return operand_order.available(interpret)


def supports(kernel: str, *, sq_len: int, sk_len: int, sq_pad: int, sk_pad: int, head_dim: int, causal: bool,
             has_bias: bool, config: SageFwdConfig) -> bool:
    """Whether the Mosaic ``kernel`` ("dkdv" or "dq") covers this backward call (else use Triton).

    Both need: no Q-smoothing bias, head dim 64 or 128, no padded keys, 64-row backward
    tiles (the dS quantization tiles of the reference) and, if causal, Sq ≤ Sk (every
    CTA then has at least two steps). Each CTA holds two warpgroups' tiles, so the
    sequence it splits must be a multiple of 128.
    """
    common = (not has_bias and head_dim in (64, 128) and sk_len == sk_pad and config.bwd_block_q == TILE
              and (not causal or sq_len <= sk_len))
    if kernel == "dkdv":
        return common and config.bwd_block_k == TILE and sk_pad % (WGS * TILE) == 0 and sq_pad % TILE == 0
    if kernel == "dq":
        return common and config.dq_block_k == TILE and sq_pad % (WGS * TILE) == 0 and sk_pad % TILE == 0
    raise ValueError(f"kernel must be 'dkdv' or 'dq', got {kernel!r}")


def supports_fused_dq(*, head_dim: int, per_block: bool, ds_per_row: bool) -> bool:
    """Whether :func:`sage_bwd_dkdv_mosaic` can also produce dQ (``SageFwdConfig.dq_kernel``): one dŜ
    per tile serves both dK = dŜᵀQ̂ and dQ = dŜK̂ only with per-block Q/K scales (per-token ones are
    folded into dS before it is quantized, differently for each product) and per-tile dS scales."""
    return head_dim in (64, 128) and per_block and not ds_per_row


def dequantized_v(vt8: jax.Array, v_scale: jax.Array, dtype, *, keys_in_operand_order: bool = False) -> jax.Array:
    """Ṽ = V̂·s_V in dO's dtype as (B, Hkv, Sk, D): the A operand of dPᵀ and the B operand of dP.

    (The Triton kernels build their Ṽ tile in-kernel from V̂ᵀ; here it is one memory-bound
    XLA op, same values: ``sage_tiles.dequantize_v_t``.) ``keys_in_operand_order``: vt8's keys are in
    :mod:`pallas_kernels.operand_order` (the forward's); Ṽ's rows are put back in natural order, as whole 16-bit
    rows (XLA fuses that into the dequantization; permuting the INT8 codes' columns instead would be a separate
    transpose).
    """
    vd = jnp.swapaxes(dequantize_v_t(vt8, v_scale, dtype), 2, 3)
    return operand_order.from_operand_order(vd, 2) if keys_in_operand_order else vd


def manual_barriers(head_dim: int, *, fused_dq: bool, interpret: bool) -> bool:
    """Whether :func:`sage_bwd_dkdv_mosaic` is compiled without Pallas's automatic barriers: at head dim 64 (at 128
    they measured level or slower), with the fused dQ, compiled, and both INT8 A operands (P̂ᵀ, dŜᵀ) from registers
    (:func:`_smem_operands`), where every SMEM tile the step rewrites is already ordered by a barrier it places:

    * the transposed dŜ (``stmatrix``, never behind one of Pallas's barriers) is last read by the previous step's
      dQ product, which every warp waits for before that step's last ``commit_smem``;
    * the tile maximum's four words (``warp_reduce.tile_absmax``) are read before the step's ``commit_smem``;
    * the float32 dQ stage is rewritten after its free (``cp.async.bulk.wait_group.read`` and a barrier) and
      published by ``commit_smem``;
    * the epilogue writes dK and dV into the Ṽ tile after ``wait_smem_to_gmem`` (a barrier) and commits them.
    """
    return head_dim <= 64 and fused_dq and not interpret and not _smem_operands(interpret)


def _ds_quantize(x: jax.Array, scratch, per_row: bool, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """ψ of a dS tile, codes rounded half to even (``int8.encode_half_even``): one scale for the whole tile
    (a scalar) or, ``per_row``, one per row (over axis 1; a row vector, no cross-warp reduction)."""
    if per_row:
        return int8.quantize_half_even(x, 1, truncating_convert=True, broadcast=lambda v: rows_of(v, x.shape))
    scale = int8.scale_from_amax(tile_absmax(x, scratch, interpret))
    return int8.encode_half_even(x, scale, truncating_convert=True), scale


# ----------------------------------------------------------------------------- dK, dV


@dataclasses.dataclass(frozen=True)
class DkdvParams:
    """The static parameters of a dK/dV(/dQ) launch.

    Attributes:
      head_dim, group (query heads per kv head), n_qtiles (64-row query tiles), stages (the pipeline's),
      causal, offset (Sk − Sq, the causal diagonal's shift).
      per_block: per-block Q/K scales (one scalar per tile) rather than per token.
      ds_per_row: dS scales per key row rather than per tile.
      fused_dq: dQ reduce-added into a float32 accumulator too (``scale`` the softmax scale for it); K̂ and Ṽ rows
        then come in :mod:`pallas_kernels.key_pairs` order and ``permuted`` says whether the dQ stage's columns
        are in ``dq_stage`` order.
      operand: Q̂ᵀ and dÔᵀ hold their queries in :mod:`pallas_kernels.operand_order`.
      split_dq: dQ split by columns between the warpgroups (head dim 128, :func:`_split_dq`); ``dq_under_dk``: its
        products before dK's, its stage store and reduce-add issued while dK's product runs.
      interpret: the Mosaic GPU interpreter runs it (products one at a time, SMEM operands).
    """

    head_dim: int
    group: int
    n_qtiles: int
    stages: int
    causal: bool
    offset: int
    per_block: bool
    ds_per_row: bool
    fused_dq: bool
    operand: bool
    scale: float | None
    permuted: bool
    interpret: bool
    split_dq: bool = False
    dq_under_dk: bool = False


def _dkdv_kernel(q_ref, qs_ref, qt_ref, lse_ref, delta_ref, do_ref, dot_ref, dosc_ref, k_ref, ks_ref, vd_ref,
                 *refs, p: DkdvParams, k_tiles, v_tiles, k_scales, row_max, barriers, dk_tiles=None, p_tiles=None,
                 ds_tiles=None, kt_tiles=None, dsq_tiles=None, dq_stage=None, exchange=None):
    """dK, dV; if ``p.fused_dq`` also dQ, reduce-added into the float32 ``dq_ref``
    (``reduce_add.reduce_add_matmul``). ``refs``: [kt_ref, dq_ref], dk_ref, dv_ref. The scratch, per compute
    warpgroup: K̂, Ṽ and K's scales, the row-maximum words of the dS tile maximum, the barriers; unfused the dK
    tile; the SMEM operands P̂ᵀ, dŜᵀ where they do not come from registers (:func:`_smem_operands`); fused K̂ᵀ,
    the transposed dŜ and the float32 dQ stage."""
    kt_ref, dq_ref, dk_ref, dv_ref = (*refs[:2], *refs[2:]) if p.fused_dq else (None, None, *refs)
    k_smem2, vd_smem2, ks_smem2, red_smem2 = k_tiles, v_tiles, k_scales, row_max
    dk_smem2, p_smem2, ds_smem2 = dk_tiles, p_tiles, ds_tiles
    kt_smem2, dsq_smem2, stage2 = kt_tiles, dsq_tiles, dq_stage
    smem_p = smem_ds = p_tiles is not None
    stages, group, n_qtiles, per_block, head_dim = p.stages, p.group, p.n_qtiles, p.per_block, p.head_dim
    causal, offset, ds_per_row, fused_dq, operand = p.causal, p.offset, p.ds_per_row, p.fused_dq, p.operand
    scale, permuted, interpret, fused = p.scale, p.permuted, p.interpret, not p.interpret
    split_dq, under = p.split_dq, p.dq_under_dk
    wg = lax.axis_index("wg")
    shape = (TILE, TILE)  # (keys, queries)
    i8, f16 = jnp.int8, do_ref.dtype

    def in_specs(head_and_tile):  # the pipeline's tiles for step i → (query head of the group, query tile)
        def q_tile(*block):  # (group, Sq_pad, *) arrays
            return lambda i: (*head_and_tile(i), *([0] * len(block)))

        def qt_tile(i):  # (group, D, Sq_pad) arrays
            g, t = head_and_tile(i)
            return g, 0, t

        vec = plgpu.BlockSpec((None, TILE), q_tile())
        return [
            plgpu.BlockSpec((None, TILE, head_dim), q_tile(0), transforms=tile_transforms(i8, head_dim)),
            vec,
            plgpu.BlockSpec((None, head_dim, TILE), qt_tile, transforms=tile_transforms(i8, TILE)),
            vec,
            vec,
            plgpu.BlockSpec((TILE, None, head_dim), lambda i: (head_and_tile(i)[1], head_and_tile(i)[0], 0),
                            transforms=tile_transforms(f16, head_dim)),
            plgpu.BlockSpec((None, head_dim, TILE), qt_tile, transforms=tile_transforms(i8, TILE)),
            vec,
        ]

    def gmem(b, hkv):  # the pipeline's arrays for the query heads of kv head hkv
        heads = pl.ds(hkv * group, group)
        return (q_ref.at[b, heads], qs_ref.at[b, heads], qt_ref.at[b, heads], lse_ref.at[b, heads],
                delta_ref.at[b, heads], do_ref.at[b, :, heads], dot_ref.at[b, heads], dosc_ref.at[b, heads])

    b, hkv, _ = grid_position()
    kv_block = lax.axis_index("kv")
    h0 = hkv * group
    # Causal: the query tiles before the first one that sees any key of this CTA are skipped
    # (not even loaded); the rest are masked element-wise (bottom-right aligned, tile_ranges).
    cta_keys = kv_block * (WGS * TILE)
    i_first = first_query_tile(cta_keys, TILE, n_qtiles, causal=causal, offset=offset)
    n_vis = n_qtiles - i_first
    head_and_tile = functools.partial(group_tile, n_tiles=n_vis, first=i_first)  # step → (head, query tile)

    def compute(pipeline):
        k_smem, vd_smem, ks_smem = k_smem2.at[wg], vd_smem2.at[wg], ks_smem2.at[wg]
        rows = pl.ds(cta_keys + wg * TILE, TILE)
        copies = [(k_ref.at[b, hkv, rows], k_smem), (vd_ref.at[b, hkv, rows], vd_smem),
                  (ks_ref.at[b, hkv, rows], ks_smem)]
        if fused_dq:
            copies.append((kt_ref.at[b, hkv, :, rows], kt_smem2.at[wg]))
        copy_in(copies, barriers, wg)
        zeros = wgmma_zeros((TILE, head_dim))
        dk, dv = pipeline((zeros, zeros))
        if fused_dq:  # no dK tile in SMEM (it would not fit beside the dQ buffers at D128): both through Ṽ's
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last dQ copy has read its SMEM
            for acc, out_ref in ((dk, dk_ref), (dv, dv_ref)):  # back to natural key order on the way to SMEM
                key_pairs.store_rows(vd_smem, acc.astype(vd_smem.dtype), interpret)
                copy_out(((vd_smem, out_ref.at[b, rows, hkv]),))
            return
        dk_smem = dk_smem2.at[wg]
        dk_smem[...] = dk.astype(dk_smem.dtype)
        vd_smem[...] = dv.astype(vd_smem.dtype)  # Ṽ is no longer needed: reuse its SMEM
        copy_out(((dk_smem, dk_ref.at[b, rows, hkv]), (vd_smem, dv_ref.at[b, rows, hkv])))

    def step(idx, *args):  # args: the eight tiles, the consumed barriers, the carry
        tiles, consumed, carry = args[:8], args[8:-1], args[-1]
        return guarded_step(lambda c: backprop(idx, *tiles, c), carry, consumed)

    def backprop(idx, q_smem, qs_smem, qt_smem, lse_smem, delta_smem, do_smem, dot_smem, dosc_smem, carry):
        dk_acc, dv_acc = carry
        k_smem, vd_smem = k_smem2.at[wg], vd_smem2.at[wg]
        # split dQ: the dŜ tiles and tile-maximum words alternate between two buffers by step, so a warpgroup
        # rewrites one only after the other warpgroup has passed the exchange of the step that read it
        parity = lax.rem(idx[0], 2) if split_dq else None
        red_smem = red_smem2.at[parity, wg] if split_dq else red_smem2.at[wg]
        dsq_smem = (dsq_smem2.at[parity, wg] if split_dq else dsq_smem2.at[wg]) if fused_dq else None
        p_smem = p_smem2.at[wg] if smem_p else None
        ds_smem = ds_smem2.at[wg] if smem_ds else None
        qs = None if per_block else col_vector(qs_smem)  # per-token Q scales
        # Sᵀ = K̂Q̂ᵀ (INT8) and dPᵀ = ṼdOᵀ (16-bit), issued together
        st, dpt = matmuls((shape, shape), (jnp.int32, jnp.float32), ((k_smem, q_smem.T), (vd_smem, do_smem.T)),
                          fused=fused)
        st = st.astype(jnp.float32)
        g, t = head_and_tile(idx[0])  # the step's query head of the group and query tile
        mask = functools.partial(mask_scores, key_start=cta_keys + wg * TILE, query_start=t * TILE, causal=True,
                                 offset=offset, transposed=True,
                                 key_of_column=key_pairs.key_of_row if fused_dq else None)
        if causal:  # masked before the scale (positive: −inf stays −inf), so scale and − L make one FFMA
            st = mask(st)
        if per_block:  # one K scale per key tile, one Q scale per query tile: a scalar each
            q0, k0 = scalar(qs_smem), scalar(ks_smem2.at[wg])
            st = st * (k0 * q0)  # base-2 scores Sᵀ
        else:
            st = st * rows_of(row_vector(ks_smem2.at[wg]), shape) * cols_of(qs, shape)
        pt = jnp.exp2(st - cols_of(col_vector(lse_smem), shape))
        # P̂ per key row of the tile for dV += P̂ᵀdÔ (dO one scale per query tile, stored repeated per row)
        p8, p_scale = int8.quantize_unit(pt, 1, truncating_convert=True, broadcast=lambda v: rows_of(v, shape))
        p_op = a_operand(p8, p_smem)
        dv_scale = p_scale * scalar(dosc_smem)
        # dSᵀ = Pᵀ ∘ (dPᵀ − D), one scale per tile, for dK += dŜᵀQ̂
        dst = pt * (dpt - cols_of(col_vector(delta_smem), shape))
        if per_block:
            ds8, ds_scale = _ds_quantize(dst, red_smem, ds_per_row, interpret)
            factor = ds_scale * q0 * (1.0 / LOG2E)
        else:
            ds8, ds_scale = _ds_quantize(dst * cols_of(qs, shape), red_smem, ds_per_row, interpret)
            factor = ds_scale * (1.0 / LOG2E)
        ds_op = a_operand(ds8, ds_smem)
        if fused_dq:  # dŜ (queries × keys), keys contiguous: the A operand of dQ += dŜK̂ (per-tile scale)
            key_pairs.store_transposed(dsq_smem, ds8, interpret)
        if fused_dq or smem_p or smem_ds:
            plgpu.commit_smem()  # P̂ or dŜ went to SMEM, or dŜ transposed
        if split_dq:  # this warpgroup's dŜ and tile maximum are in SMEM for the other's half of dQ
            plgpu.barrier_arrive(exchange)
        # dV and dK (INT8): issued together at head dim 64 (causal, with the fused dQ, dQ's dŜK̂ too); at 128
        # one after the other, since two (64 × 128) int32 products beside the dK, dV accumulators spill registers
        products = ((p_op, dot_smem.T), (ds_op, qt_smem.T))
        out_shape = (TILE, head_dim)
        dq_factor = ds_scale * k0 * scale if fused_dq else None  # dS scale · K scale · softmax scale
        if fused_dq:
            acc = reduce_add_slot(dq_ref, (kv_block, wg), interpret=interpret)
            dq_dst = lambda cols: acc.at[b, pl.ds(t * TILE, TILE), h0 + g, cols]  # noqa: E731
            kt_smem = kt_smem2.at[wg]
        dq_joins = fused_dq and head_dim <= 64 and causal  # non-causal, dQ's own wait measured faster

        def split_dq_add():  # head dim 128: this warpgroup's half of dQ summed, its reduce-add to be issued
            total = _split_dq(exchange, parity, wg, dq_factor, dsq_smem2, kt_smem2, red_smem2, ks_smem2,
                              scale=scale, interpret=interpret)
            return functools.partial(reduce_add_product, stage2.at[wg], total,
                                     dq_dst(pl.ds(wg * REDUCE_COLS, REDUCE_COLS)), interpret=interpret, waited=True,
                                     permuted=permuted)

        if dq_joins:  # the dQ stage freed while the three run (reduce_add.early_stage_wait)
            free = early_stage_wait()
            dv_part, dk_part, dq_part = matmuls((out_shape,) * 3, (jnp.int32,) * 3,
                                                (*products, (dsq_smem, kt_smem.T)), fused=fused,
                                                issued=free)
        elif head_dim <= 64:
            dv_part, dk_part = matmuls((out_shape,) * 2, (jnp.int32,) * 2, products, fused=fused)
        else:
            dv_part = matmul(out_shape, jnp.int32, *products[0])
        dv_acc = dv_acc + dv_part.astype(jnp.float32) * rows_of(dv_scale, out_shape)
        if head_dim > 64:  # under dK: split dQ summed now, its stage store and reduce-add issued while dK's runs
            dk_part = matmul(out_shape, jnp.int32, *products[1], issued=split_dq_add() if under else None)
        dk_acc = dk_acc + dk_part.astype(jnp.float32) * (rows_of(factor, out_shape) if ds_per_row else factor)
        if dq_joins:  # dQ += dŜK̂ · dq_factor, INT8, reduce-added into the float32 dQ
            reduce_add_product(stage2.at[wg], dq_part, dq_dst(pl.ds(0, head_dim)), interpret=interpret,
                               factor=dq_factor, waited=True, permuted=permuted)
        elif split_dq and not under:  # (under dK: added while dK's product ran)
            split_dq_add()()
        elif fused_dq and not split_dq:  # head dim 64 non-causal: the stage freed after the product (early: slower)
            reduce_add_matmul(stage2.at[wg], dsq_smem, lambda cols: kt_smem.at[cols].T, head_dim, dq_dst,
                              interpret=interpret, acc_dtype=jnp.int32, factor=dq_factor,
                              early=False, permuted=permuted)
        return dk_acc, dv_acc

    def a_operand(codes, scratch):  # an INT8 A operand of dV or dK (committed after both)
        if operand:  # Q̂ᵀ, dÔᵀ in operand order: the registers as they are
            return operand_order.register_operand(codes, scratch, interpret, commit=False)
        return register_operand(codes, scratch, interpret, commit=False)

    pipeline = compute_pipeline(step, compute, steps=group * n_vis, compute_wgs=WGS, stages=stages,
                                in_specs=in_specs(head_and_tile))
    pipeline(*gmem(b, hkv))


def _split_dq(exchange, parity, wg, own_factor, dsq_smem2, kt_smem2, red_smem2, ks_smem2, *, scale: float,
              interpret: bool) -> jax.Array:
    """dQ at head dim 128, split by columns between the two compute warpgroups: warpgroup w reduce-adds dQ's
    64-column half w over the CTA's 128 keys, the sum over both warpgroups h of dŜ_h · K̂_h[:, half w] · s_h (each
    dŜ tile with its own scale s_h = s_dS · s_K · softmax scale; the other warpgroup's rebuilt from its tile-maximum
    words). One (64 × 64) float32 tile a warpgroup and step goes through SMEM to GMEM instead of a (64 × 128) one:
    half the reduce-add traffic, which was most of dQ's cost. Waits on ``exchange`` first (both warpgroups' dŜ
    stored and committed). The two warpgroups are indexed by ``wg`` and ``1 − wg`` (traced, not literal
    indices, which Mosaic GPU cannot carry through the products' ``run_state``). Returns warpgroup w's (64 × 64)
    float32 half, for the caller to reduce-add (``SageFwdConfig.split_dq_schedule``: right away, or while dK's
    product runs)."""
    plgpu.barrier_wait(exchange)
    other = 1 - wg
    cols = pl.ds(wg * REDUCE_COLS, REDUCE_COLS)
    other_factor = (int8.scale_from_amax(tile_absmax_of(red_smem2.at[parity, other], interpret))
                    * scalar(ks_smem2.at[other]) * scale)
    parts = matmuls(((TILE, REDUCE_COLS),) * 2, (jnp.int32,) * 2,
                    tuple((dsq_smem2.at[parity, h], kt_smem2.at[h].at[cols].T) for h in (wg, other)),
                    fused=not interpret, issued=early_stage_wait())
    total = parts[0].astype(jnp.float32) * own_factor + parts[1].astype(jnp.float32) * other_factor
    return total


# ----------------------------------------------------------------------------- dQ


def _dq_kernel(q_ref, qs_ref, lse_ref, delta_ref, do_ref, k_ref, ks_ref, kt_ref, vd_ref, dq_ref,
               q_smem2, do_smem2, qs_smem2, lse_smem2, delta_smem2, *scratch, group, scale, per_block, head_dim,
               fused, causal, offset, ds_per_row, interpret):
    """dQ. ``scratch``: [dŜ (:func:`_smem_operands`)], the row-maximum vectors, the barriers."""
    smem_ds = _smem_operands(interpret)
    ds_smem2, red_smem2, barriers = scratch if smem_ds else (None, *scratch)
    b, h, wg = grid_position()
    hkv = lax.div(h, group)
    shape = (TILE, TILE)  # (queries, keys)
    # Causal: stop after the last key tile any query of this CTA sees (the heaviest query blocks launch
    # first); mask element-wise (no padded keys).
    cta_queries, n_steps, _ = query_block_keys(WGS * TILE, k_ref.shape[2], TILE, sk_len=k_ref.shape[2],
                                               causal=causal, offset=offset,
                                               heavy_first_of=q_ref.shape[2] // (WGS * TILE))

    def compute(pipeline):
        q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
        rows = pl.ds(cta_queries + wg * TILE, TILE)
        copies = ((q_ref.at[b, h, rows], q_smem), (do_ref.at[b, rows, h], do_smem),
                  (qs_ref.at[b, h, rows], qs_smem2.at[wg]), (lse_ref.at[b, h, rows], lse_smem2.at[wg]),
                  (delta_ref.at[b, h, rows], delta_smem2.at[wg]))
        copy_in(copies, barriers, wg)
        dq = pipeline(wgmma_zeros((TILE, head_dim)))
        do_smem[...] = dq.astype(do_smem.dtype)  # dO is no longer needed: reuse its SMEM
        copy_out(((do_smem, dq_ref.at[b, rows, h]),))

    def step(idx, k_smem, ks_smem, kt_smem, vd_smem, *consumed_and_carry):
        *consumed, dq_acc = consumed_and_carry
        q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
        ds_smem = ds_smem2.at[wg] if smem_ds else None
        ks = None if per_block else col_vector(ks_smem)  # per-token K scales
        s, dp = matmuls((shape, shape), (jnp.int32, jnp.float32),
                        ((q_smem, k_smem.T), (do_smem, vd_smem.T)), fused=fused)
        s = s.astype(jnp.float32)
        mask = functools.partial(mask_scores, key_start=idx[0] * TILE, query_start=cta_queries + wg * TILE,
                                 causal=True, offset=offset)
        if causal:  # masked before the scale, as in the dK/dV kernel
            s = mask(s)
        if per_block:  # one Q scale per query tile, one K scale per key tile: a scalar each
            k0 = scalar(ks_smem)
            s = s * (scalar(qs_smem2.at[wg]) * k0)
        else:
            s = s * rows_of(row_vector(qs_smem2.at[wg]), shape) * cols_of(ks, shape)
        p = jnp.exp2(s - rows_of(row_vector(lse_smem2.at[wg]), shape))
        ds = p * (dp - rows_of(row_vector(delta_smem2.at[wg]), shape))
        if per_block:
            ds8, ds_scale = _ds_quantize(ds, red_smem2.at[wg], ds_per_row, interpret)
            factor = ds_scale * k0 * scale
        else:
            ds8, ds_scale = _ds_quantize(ds * cols_of(ks, shape), red_smem2.at[wg], ds_per_row, interpret)
            factor = ds_scale * scale
        ds_op = register_operand(ds8, ds_smem, interpret)
        dq_part = matmul((TILE, head_dim), jnp.int32, ds_op, kt_smem.T)
        for barrier in consumed:
            plgpu.barrier_arrive(barrier)
        return dq_acc + dq_part.astype(jnp.float32) * (rows_of(factor, dq_part.shape) if ds_per_row else factor)

    pipeline = compute_pipeline(
        step, compute, steps=n_steps, compute_wgs=WGS, stages=STAGES, in_specs=[
            *key_step_specs(TILE, head_dim), transposed_step_spec(TILE, head_dim),
            plgpu.BlockSpec((TILE, head_dim), lambda j: (j, 0), transforms=tile_transforms(vd_ref.dtype, head_dim)),
        ],
    )
    pipeline(k_ref.at[b, hkv], ks_ref.at[b, hkv], kt_ref.at[b, hkv], vd_ref.at[b, hkv])


# ----------------------------------------------------------------------------- calls


def sage_bwd_dkdv_mosaic(q8, q_scale, q8_t, lse_pad, delta, do, do8_t, do_scale, k8, k_scale, vd, *,
                         sq_len: int, sk_len: int, causal: bool, per_block: bool, ds_per_row: bool = False,
                         k8_t: jax.Array | None = None, scale: float | None = None,
                         operand_order_in: bool = False, keys_in_pair_order: bool = False,
                         dq_zeros: jax.Array | None = None, dq_stage_order: str = "auto",
                         split_dq_schedule: str = "after_dk", interpret: bool = False) -> tuple[jax.Array, ...]:
    """dK, dV (B, Sk, Hkv, D) in do's dtype. Inputs as the Triton dK/dV kernel's; ``vd`` is
    Ṽ = V̂·s_V in dO's dtype, (B, Hkv, Sk, D); ``lse_pad`` is (B, Hq, Sq_pad) with +inf padding;
    ``ds_per_row``: dS scales per key instead of per tile (``SageFwdConfig.ds_scale="row"``).

    With ``k8_t`` (K̂ᵀ, (B, Hkv, D, Sk)) and ``scale`` (the softmax scale) it also returns dQ
    (B, Sq, Hq, D) — the fused backward (:func:`supports_fused_dq`): each step's dŜ·K̂ is
    reduce-added into a float32 dQ (its summation order varies run to run).

    ``operand_order_in``: q8_t's and do8_t's queries are in :mod:`pallas_kernels.operand_order`
    (``sage_quantize_q``'s ``t_operand_order``, ``sage_bwd_preprocess``'s ``operand_order``): P̂ᵀ and dŜᵀ are
    then the A operands of dV and dK as the registers hold them. Only where :func:`takes_operand_order`.

    ``keys_in_pair_order``: k8's and vd's keys are already in :mod:`pallas_kernels.key_pairs` order
    (``sage_bwd.sage_bwd_kv_operands``); only with the fused dQ. Otherwise they are natural and, with the fused
    dQ, permuted here by XLA.

    ``dq_zeros``: with the fused dQ, a zeroed float32 (B, Sq_pad, Hq, D) array to accumulate dQ in
    (``sage_bwd.sage_bwd_preprocess(zero_dq=True)``); without it the accumulator is filled here.

    ``dq_stage_order``, ``split_dq_schedule``: the fused dQ's stage order and, at head dim 128, its place in the
    step (``SageFwdConfig``'s fields of those names; scheduling only, the values are the same).
    """
    b, hq, sq_pad, d = q8.shape
    hkv, sk_pad = k8.shape[1], k8.shape[2]
    f16, i8, f32 = do.dtype, jnp.int8, jnp.float32
    do = pad_rows(do, tma_rows(sq_len))  # read by tiled TMA loads
    fused_dq = k8_t is not None
    if split_dq_schedule not in SPLIT_DQ_SCHEDULES:
        raise ValueError(f"split_dq_schedule must be one of {SPLIT_DQ_SCHEDULES}, got {split_dq_schedule!r}")
    if fused_dq and not supports_fused_dq(head_dim=d, per_block=per_block, ds_per_row=ds_per_row):
        raise ValueError("the fused dQ needs per-block Q/K scales and per-tile dS scales")
    if fused_dq and scale is None:
        raise ValueError("the fused dQ needs scale (the softmax scale) beside k8_t")
    if keys_in_pair_order and not fused_dq:
        raise ValueError("keys_in_pair_order: K̂ and Ṽ come in pair order only with the fused dQ")
    if fused_dq and not keys_in_pair_order:  # the kernel's K̂ and Ṽ rows in pair order (Ṽ's permutation fuses into
        # its dequantization); the fused dQ has per-block K scales (supports_fused_dq), equal on every key of a
        # 16-key block: left as they are
        k8, vd = key_pairs.to_pair_order(k8, 2), key_pairs.to_pair_order(vd, 2)
    permuted = fused_dq and dq_stage.permutes(d, interpret, dq_stage_order)
    if operand_order_in and not takes_operand_order(interpret):
        raise ValueError("operand_order_in: the kernel takes Q̂ᵀ, dÔᵀ in operand order only where "
                         "takes_operand_order()")
    kv_blocks = sk_pad // (WGS * TILE)
    split_dq = fused_dq and d == WGS * REDUCE_COLS  # dQ's columns split between the warpgroups (_split_dq)
    params = DkdvParams(head_dim=d, group=hq // hkv, n_qtiles=sq_pad // TILE, stages=_dkdv_stages(d), causal=causal,
                        offset=sk_len - sq_len, per_block=per_block, ds_per_row=ds_per_row, fused_dq=fused_dq,
                        operand=operand_order_in, scale=scale, permuted=permuted, interpret=interpret,
                        split_dq=split_dq, dq_under_dk=split_dq and split_dq_schedule == "under_dk")
    buffers = (2,) if split_dq else ()  # split dQ: two of the exchanged scratch, alternating by step
    scratch = dict(k_tiles=wg_tiles(WGS, TILE, i8, d), v_tiles=wg_tiles(WGS, TILE, f16, d),
                   k_scales=plgpu.SMEM((WGS, TILE), f32), row_max=plgpu.SMEM((*buffers, WGS, TILE), f32),
                   barriers=plgpu.Barrier(num_barriers=(4 if fused_dq else 3, WGS)))
    if not fused_dq:
        scratch["dk_tiles"] = wg_tiles(WGS, TILE, f16, d)
    if _smem_operands(interpret):
        scratch.update(p_tiles=wg_tiles(WGS, TILE, i8, TILE), ds_tiles=wg_tiles(WGS, TILE, i8, TILE))
    args = [q8, q_scale, q8_t, lse_pad, delta, do, do8_t, do_scale, k8, k_scale, vd]
    if fused_dq:
        # K̂ᵀ, dŜ (queries × keys) and the float32 stage per warpgroup; the float32 dQ (one per key block
        # and warpgroup interpreted)
        scratch.update(kt_tiles=wg_tiles(WGS, d, i8, TILE),
                       dsq_tiles=plgpu.SMEM((*buffers, WGS, TILE, TILE), i8, transforms=tile_transforms(i8, TILE)),
                       dq_stage=reduce_add_stage(WGS, TILE))  # 64 columns a warpgroup at either head dim
        if split_dq:
            scratch["exchange"] = plgpu.Barrier(num_arrivals=WGS)
        args += [k8_t, reduce_add_accumulator((b, sq_pad, hq, d), (kv_blocks, WGS), interpret=interpret,
                                              after=do, zeros=dq_zeros)]
    elif dq_zeros is not None:
        raise ValueError("dq_zeros: only the fused dQ (k8_t given) accumulates dQ")
    dk, dv = launch(functools.partial(_dkdv_kernel, p=params), [jax.ShapeDtypeStruct((b, tma_rows(sk_len), hkv, d),
                                                                                      f16)] * 2, scratch,
                    (hkv, kv_blocks, b), ("heads", "kv", "batch"), compute_wgs=WGS, interpret=interpret,
                    name="sage_bwd_dkdv_dq" if fused_dq else "sage_bwd_dkdv",
                    manual_barriers=manual_barriers(d, fused_dq=fused_dq, interpret=interpret))(*args)
    dk, dv = trim_rows(dk, sk_len), trim_rows(dv, sk_len)
    if not fused_dq:
        return dk, dv
    dq = reduce_add_total(args[-1], 2, interpret=interpret, permuted=permuted)
    return dq[:, :sq_len].astype(f16), dk, dv


def sage_bwd_dq_mosaic(q8, q_scale, lse_pad, delta, do, k8, k_scale, k8_t, vd, *, sq_len: int, sk_len: int,
                       causal: bool, per_block: bool, scale: float, ds_per_row: bool = False,
                       interpret: bool = False) -> jax.Array:
    """dQ (B, Sq, Hq, D) in do's dtype. Inputs as :func:`sage_bwd_dkdv_mosaic` plus K̂ᵀ (B, Hkv, D, Sk);
    ``ds_per_row``: dS scales per query row instead of per tile."""
    b, hq, sq_pad, d = q8.shape
    f16, i8, f32 = do.dtype, jnp.int8, jnp.float32
    do = pad_rows(do, tma_rows(sq_len))  # read by tiled TMA loads
    kernel = functools.partial(_dq_kernel, group=hq // k8.shape[1], scale=scale, per_block=per_block, head_dim=d,
                               fused=not interpret, causal=causal, offset=sk_len - sq_len, ds_per_row=ds_per_row,
                               interpret=interpret)
    ds_tiles = [wg_tiles(WGS, TILE, i8, TILE)] if _smem_operands(interpret) else []  # dŜ if in SMEM
    scratch = [wg_tiles(WGS, TILE, i8, d), wg_tiles(WGS, TILE, f16, d)] + [plgpu.SMEM((WGS, TILE), f32)] * 3 + [
        *ds_tiles, plgpu.SMEM((WGS, TILE), f32), plgpu.Barrier(num_barriers=(5, WGS))]
    dq = launch(kernel, jax.ShapeDtypeStruct((b, tma_rows(sq_len), hq, d), f16), scratch,
                (hq, sq_pad // (WGS * TILE), b), ("heads", "q", "batch"), name="sage_bwd_dq", compute_wgs=WGS,
                interpret=interpret,
                )(q8, q_scale, lse_pad, delta, do, k8, k_scale, k8_t, vd)
    return trim_rows(dq, sq_len)
