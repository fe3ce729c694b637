"""Attn-QAT backward in Pallas Mosaic GPU (Hopper): the two kernels of :mod:`pallas_kernels.qat_bwd`.

Same numerics as the Triton kernels and ``lowbit_jax.qat_reference.qat_backward_reference``: S = Q̃K̃ᵀ·scale·log2 e,
E = exp2(S − m) with the forward's row max m, P = E·(1/l); dV += (FQ(E)·(1/l))ᵀdO — FP4 fake quantization in groups
of 16 keys per row, relative to the row max as in the forward, computed as e2m1 · (sf·(1/l)) and for bf16 in bf16
arithmetic (``pallas_kernels.numerics.nvfp4.fake_quant_probabilities``) — or PᵀdO for the naive ablation;
dP = dO·Ṽᵀ; dS = P ∘ (dP − D) rounded to the 16-bit operand dtype; dK += dSᵀQ̃, dQ += dS·K̃, both times ``scale``.
D = rowsum(dO ∘ O'), m and 1/l come from ``numerics.qat_rows.backward_rows`` (one XLA-fused, memory-bound op); the
kernels read dO as it is, (B, Sq, Hq, D), by TMA, one head's rows per copy.

Both kernels: a memory warpgroup streams tiles through a TMA pipeline to two compute warpgroups of 64 rows each,
16-bit ``wgmma`` with fp32 accumulators updated in place, the two independent products of a step issued together.

* dK/dV: grid (kv head, 128-key block, batch); each warpgroup owns 64 keys and loops over the query tiles of every
  query head of its GQA group. The tiles are computed as (queries × keys), with K̃ and Ṽ in lane order
  (:mod:`pallas_kernels.lane_groups`: each thread holds whole FP4 groups of 16 keys; dK and dV go back to key order
  on their way to SMEM, ``stmatrix.store_rows``); FQ(P)·(1/l) and dS go through SMEM and enter dV and dK as
  transposed A operands. Where :func:`p_last` says so, dS is stored and dK's product (with the fused dQ's) issued
  before FQ(P) is computed, and dV's product after it, so the fake quantization runs while the tensor cores work;
  there the kernel is compiled without Pallas's automatic warpgroup barriers and places one per step itself.
* dQ: grid (query head, 128-query block, batch); each warpgroup owns 64 queries and loops over key tiles; dS is the
  register A operand of dS·K̃.
* or dQ fused into the dK/dV kernel (``fused_dq``, ``QatConfig.dq_kernel``, the default): each step's dS·K̃ is
  reduce-added by TMA into a float32 dQ (FlashAttention-3's accumulation, :mod:`pallas_kernels.reduce_add`); at
  head dim 128 split by columns between the two warpgroups after a CTA-wide barrier (:func:`splits_dq_columns`);
  where :func:`dq_first` says so the dQ product is issued before dV's and dK's and reduce-added while they run.

Causal (bottom-right aligned, Sq ≤ Sk): the dK/dV pipeline starts at the first query tile that sees the block's
keys, the dQ pipeline stops after the last key tile its queries see (its heaviest query blocks launch first); tiles
that reach the diagonal or the ragged key tail are masked element-wise, the others skip the mask. Not covered
(:func:`supports`): head dims other than 64/128, sequence paddings not a multiple of 128, 32-bit dO, Sq > Sk when
causal. FlashAttention-3's ping-pong made these kernels slower, so only the forward has it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.numerics.qat_rows import backward_rows
from pallas_kernels import dq_stage, lane_groups, stmatrix
from pallas_kernels._mosaic import (
    PingPong, accumulate, compute_pipeline, copy_in, copy_out, first_query_tile, grid_position, group_tile,
    launch, mask_scores, matmul_sum, matmuls, pl, plgpu, query_block_keys, product_first, row_vector, rows_of,
    schedule_barrier, tile_transforms, warpgroup_barrier, wg_tiles, tma_rows, trim_rows, wgmma_zeros,
)
from pallas_kernels.reduce_add import (
    REDUCE_COLS, early_stage_wait, reduce_add_accumulator, reduce_add_matmul, reduce_add_out, reduce_add_slot,
    reduce_add_stage, reduce_add_total,
)
from pallas_kernels.register_operands import register_operand

LOG2E = math.log2(math.e)
TILE = 64  # rows per compute warpgroup, and the pipelined tile
WGS = 2
STAGES = 2


def _dkdv_stages(head_dim: int) -> int:
    """Pipeline stages of the dK/dV kernel's query tiles (Q̃, dO, the row vectors): three at head dim 64, where SMEM
    has room for them."""
    return 3 if head_dim <= 64 else STAGES


def manual_barriers(head_dim: int, causal: bool) -> bool:
    """Whether the dK/dV kernel places its own warpgroup barriers (one per step once S and dP are waited for, none
    around the stores of P̃ and dS, whose ``commit_smem`` ends in one) instead of Pallas's bar.sync on both sides of
    every store to SMEM: where :func:`p_last` holds (at head dim 64 causal, with FQ(P) first, it measured slower)."""
    return p_last(head_dim, causal)


def splits_dq_columns(head_dim: int) -> bool:
    """Whether the fused dQ of :func:`qat_attention_bwd_mosaic` is split by columns between the two warpgroups.

    Split: after one CTA-wide barrier per step both warpgroups' dS tiles are in SMEM, and warpgroup w
    reduce-adds dQ's columns w·D/2… summed over the CTA's 128 keys (Σ_w dS_w·K̃_w[:, cols], one
    accumulator), instead of each adding all D columns over its own 64 keys: half the TMA reduce traffic,
    the warpgroups held in step: at head dim 128 (at 64 it was slower, and a column half of K̃ spans whole
    128-byte swizzle rows only from 128).
    """
    return head_dim >= 2 * REDUCE_COLS


def supports(*, sq_len: int, sk_len: int, sq_pad: int, sk_pad: int, head_dim: int, causal: bool, dtype,
             do_dtype) -> bool:
    """Whether the Mosaic backward covers this call (else the Triton kernels run)."""
    sixteen_bit = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return (head_dim in (64, 128) and sq_pad % (WGS * TILE) == 0 and sk_pad % (WGS * TILE) == 0
            and jnp.dtype(dtype) in sixteen_bit and jnp.dtype(do_dtype) == jnp.dtype(dtype)
            and (not causal or sq_len <= sk_len))


def dq_first(head_dim: int, causal: bool) -> bool:
    """Whether the fused dQ's product is issued before dV's and dK's, and only it is waited for before its TMA
    reduce-add (``_mosaic.product_first``): with the column split (head dim 128), causal, or where FQ(P) comes last
    (its product then runs under FQ(P) with dK's); non-causal at head dim 64 with FQ(P) first it measured slower."""
    return causal or splits_dq_columns(head_dim) or p_last(head_dim, causal)


def p_last(head_dim: int, causal: bool) -> bool:
    """Whether the dK/dV kernel computes FQ(P) after dS's products are issued (``_mosaic.accumulate``'s late
    operand), so the fake quantization runs while they occupy the tensor cores: at head dim 128, and at 64
    non-causal (causal at 64 it measured slower)."""
    return head_dim > 64 or not causal


def scale_in_exp(head_dim: int) -> bool:
    """Whether the kernels keep S unscaled and fold the softmax scale into the exponent (``exp2(s·c − m)``, one
    FFMA per score): at head dim 64 (at 128 it measured slower)."""
    return head_dim <= 64


def _scores(q_smem, k_smem, do_smem, v_smem, *, score_scale, head_dim, fused):
    """S (times scale·log2 e unless :func:`scale_in_exp`) and dP = dO·Ṽᵀ for a (queries × keys) tile, issued
    together."""
    shape = (q_smem.shape[0], k_smem.shape[0])
    s, dp = matmuls((shape, shape), (jnp.float32, jnp.float32), ((q_smem, k_smem.T), (do_smem, v_smem.T)),
                    fused=fused)
    return (s if scale_in_exp(head_dim) else s * score_scale), dp


def _exponentials(s, m_row, score_scale, head_dim):
    """E = exp2(S·scale·log2 e − m) (row max 1) from :func:`_scores`' S and the forward's base-2 row max."""
    if scale_in_exp(head_dim):
        return jnp.exp2(s * score_scale - rows_of(m_row, s.shape))  # s·c − m: one FFMA
    return jnp.exp2(s - rows_of(m_row, s.shape))


def _ds(e, dp, inv_l_row, delta_row, dtype):
    """dS = P ∘ (dP − D) with P = E·(1/l), rounded to ``dtype``."""
    shape = e.shape
    return (e * rows_of(inv_l_row, shape) * (dp - rows_of(delta_row, shape))).astype(dtype)


@dataclasses.dataclass(frozen=True)
class DkdvParams:
    """The static parameters of a dK/dV(/dQ) launch.

    Attributes:
      head_dim, group (query heads per kv head), n_qtiles (64-row query tiles), stages (the pipeline's),
      sk_len, causal, offset (Sk − Sq, the causal diagonal's shift).
      score_scale, scale: the softmax scale times log2 e, and the softmax scale.
      naive: the naive (16-bit) backward's dV = PᵀdO instead of FQ(P)ᵀdO.
      fused_dq: dQ reduce-added into a float32 accumulator too; ``split`` by columns between the warpgroups
        (:func:`splits_dq_columns`), ``permuted``: the dQ stage's columns in ``dq_stage`` order.
      interpret: the Mosaic GPU interpreter runs it.
    """

    head_dim: int
    group: int
    n_qtiles: int
    stages: int
    sk_len: int
    causal: bool
    offset: int
    score_scale: float
    scale: float
    naive: bool
    fused_dq: bool
    split: bool
    permuted: bool
    interpret: bool


def _dkdv_kernel(q_ref, do_ref, m_ref, il_ref, delta_ref, k_ref, v_ref, *refs, p: DkdvParams, k_tiles, v_tiles,
                 p_tiles, ds_tiles, barriers, dq_stage=None, cta_barrier=None):
    """dK, dV; if ``p.fused_dq`` also dQ, reduce-added into the float32 ``dq_ref``
    (``reduce_add.reduce_add_matmul``). ``refs``: [dq_ref], dk_ref, dv_ref. The scratch, per compute warpgroup:
    K̃, Ṽ, FQ(P)·(1/l) and dS (double-buffered by step parity when split), the barriers; fused the float32 dQ
    stage and, split, the CTA-wide barrier."""
    dq_ref, dk_ref, dv_ref = refs if p.fused_dq else (None, *refs)
    k_smem2, v_smem2, p_smem2, ds_smem2, stage2 = k_tiles, v_tiles, p_tiles, ds_tiles, dq_stage
    stages, group, n_qtiles, head_dim, sk_len, causal = p.stages, p.group, p.n_qtiles, p.head_dim, p.sk_len, p.causal
    offset, score_scale, scale, naive, interpret = p.offset, p.score_scale, p.scale, p.naive, p.interpret
    fused_dq, split, permuted = p.fused_dq, p.split, p.permuted
    wg = lax.axis_index("wg")
    # split: both warpgroups meet at the CTA-wide barrier (PingPong's two-arrival barrier as a plain rendezvous)
    cta_sync = PingPong(cta_barrier, wg, enabled=True).sync if split else None
    out_shape, half = (TILE, head_dim), head_dim // 2
    # manual_barriers(): launched without Pallas's barriers (the interpreter has none to drop)
    manual = manual_barriers(head_dim, causal) and not interpret
    masked = causal or sk_len != k_ref.shape[2]  # causal or padded keys
    dt = q_ref.dtype

    def in_specs(head_and_tile):  # the pipeline's tiles for step i → (query head of the group, query tile)
        tile = plgpu.BlockSpec((None, TILE, head_dim), lambda i: (*head_and_tile(i), 0),
                               transforms=tile_transforms(dt, head_dim))
        vec = plgpu.BlockSpec((None, TILE), head_and_tile)
        # dO (B, Sq_pad, Hq, D): a tile is TILE rows of one head, read by TMA with the head's stride
        do_tile = plgpu.BlockSpec((TILE, None, head_dim), lambda i: (head_and_tile(i)[1], head_and_tile(i)[0], 0),
                                  transforms=tile_transforms(dt, head_dim))
        return [tile, do_tile, vec, vec, vec]

    def gmem(b, hkv):  # the pipeline's arrays for the query heads of kv head hkv
        heads = pl.ds(hkv * group, group)
        return (q_ref.at[b, heads], do_ref.at[b, :, heads], m_ref.at[b, heads], il_ref.at[b, heads],
                delta_ref.at[b, heads])

    b, hkv, _ = grid_position()
    kv_block = lax.axis_index("kv")
    cta_keys = kv_block * (WGS * TILE)
    key_start = cta_keys + wg * TILE
    rows = pl.ds(key_start, TILE)
    # Causal: query tiles before i_first see none of this CTA's keys (not even loaded).
    i_first = first_query_tile(cta_keys, TILE, n_qtiles, causal=causal, offset=offset)
    n_vis = n_qtiles - i_first
    head_and_tile = functools.partial(group_tile, n_tiles=n_vis, first=i_first)  # step → (head, query tile)

    def compute(pipeline):
        k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
        copy_in(((k_ref.at[b, hkv, rows], k_smem), (v_ref.at[b, hkv, rows], v_smem)), barriers, wg)
        zeros = wgmma_zeros(out_shape)
        dk, dv = pipeline((zeros, zeros))
        if split:  # the other warpgroup's last dQ products have read this K̃ tile
            cta_sync()
        # K̃ and Ṽ are no longer needed: reuse their SMEM; lane-ordered rows go back to key order on the way. Every
        # warp is first past its wait for the last products that read them (the stmatrix stores are inline Mosaic
        # GPU, which Pallas puts no barrier before; a plain store has one unless ``manual``)
        if not interpret:
            warpgroup_barrier(interpret)
        for acc, smem in (((dk * scale), k_smem), (dv, v_smem)):
            stmatrix.store_rows(smem, acc.astype(smem.dtype), interpret, key_of_row=lane_groups.key_of_column,
                                from_order=lane_groups.from_lane_order)
        copy_out(((k_smem, dk_ref.at[b, rows, hkv]), (v_smem, dv_ref.at[b, rows, hkv])))

    def step(idx, q_smem, do_smem, m_smem, il_smem, delta_smem, *consumed_and_carry):
        *consumed, (dk, dv) = consumed_and_carry
        # split: the dS tiles the other warpgroup reads are double-buffered by step parity
        ds_tile = (lambda w: ds_smem2.at[lax.rem(idx[0], 2), w]) if split else (  # noqa: E731
            lambda w: ds_smem2.at[w])
        k_smem, v_smem, p_smem, ds_smem = k_smem2.at[wg], v_smem2.at[wg], p_smem2.at[wg], ds_tile(wg)
        s, dp = _scores(q_smem, k_smem, do_smem, v_smem, score_scale=score_scale, head_dim=head_dim,
                        fused=not interpret)
        if manual:  # the last step's products (which read P̃ and dS) are done in every warp: both may be rewritten
            warpgroup_barrier(interpret)
        g, t = head_and_tile(idx[0])  # the step's query head of the group and query tile
        if masked:
            s = mask_scores(s, key_start, t * TILE, causal=causal, offset=offset, sk_len=sk_len,
                            key_of_column=lane_groups.key_of_column)
        e = _exponentials(s, row_vector(m_smem), score_scale, head_dim)  # row max 1: FQ relative to it
        il_row = row_vector(il_smem)
        inv_l = rows_of(il_row, s.shape)

        def p_operand():  # P̃·(1/l) = e2m1 · (sf·(1/l)) (the scale product once per FP4 group) → dV's A operand
            p_smem[...] = ((e * inv_l).astype(dt) if naive
                           else lane_groups.fake_quant_p(e, interpret, times=inv_l, dtype=dt))
            return p_smem.T, do_smem

        def late_p_operand():  # after dS's products are issued (p_last)
            operand = p_operand()
            plgpu.commit_smem()
            return operand

        late = p_last(head_dim, causal)
        dv_operand = late_p_operand if late else p_operand()
        ds_smem[...] = _ds(e, dp, il_row, row_vector(delta_smem), dt)
        plgpu.commit_smem()
        if split:  # both warpgroups' dS tiles are published
            cta_sync()
        # p_last: dK's product (and a first dQ's) before FQ(P), dV's after it; else dV's, then dK's
        if late:
            accs, products = (dk, dv), ((ds_smem.T, q_smem), dv_operand)
        else:
            accs, products = (dv, dk), (dv_operand, (ds_smem.T, q_smem))
        if fused_dq:
            acc = reduce_add_slot(dq_ref, (kv_block, wg), interpret=interpret)
            dq_dst = lambda cols: acc.at[b, pl.ds(t * TILE, TILE), hkv * group + g, cols]  # noqa: E731
        # one dQ product a step: split, columns wg·D/2… over the CTA's 128 keys, Σ_w dS_w·K̃_w[:, cols] (whole
        # 128-byte swizzle rows of K̃, splits_dq_columns); else, up to REDUCE_COLS columns, dS·K̃
        one_dq = fused_dq and (split or head_dim <= REDUCE_COLS)
        first = one_dq and dq_first(head_dim, causal)
        if one_dq:
            cols = pl.ds(wg * half, half) if split else pl.ds(0, head_dim)
            dq_product = ((TILE, half if split else head_dim), jnp.float32,
                          tuple((ds_tile(w), k_smem2.at[w, :, cols]) for w in (wg, 1 - wg)) if split
                          else ((ds_smem, k_smem.at[:, cols]),))
            # issued first, its stage is freed while the three products run (reduce_add.early_stage_wait; issued
            # after dV and dK, freeing it early measured slower)
            free = early_stage_wait() if first else None
            add_dq = lambda dq: reduce_add_out(stage2.at[wg], dq, dq_dst(cols), interpret=interpret,  # noqa: E731
                                               waited=free is not None, permuted=permuted)
        if first:  # reduce-added while dV's and dK's products run
            accs = product_first(dq_product, accs, products, add_dq, fused=not interpret, issued=free)
        else:
            accs = accumulate(accs, products, fused=not interpret)
            if one_dq:
                add_dq(matmul_sum(*dq_product, fused=not interpret))
            elif fused_dq:  # unsplit beyond REDUCE_COLS columns: one product and reduce-add per chunk
                reduce_add_matmul(stage2.at[wg], ds_smem, lambda cols: k_smem.at[:, cols], head_dim, dq_dst,
                                  interpret=interpret)
        dk, dv = accs if late else accs[::-1]
        for barrier in consumed:
            plgpu.barrier_arrive(barrier)
        return dk, dv

    pipeline = compute_pipeline(step, compute, steps=group * n_vis, compute_wgs=WGS, stages=stages,
                                in_specs=in_specs(head_and_tile))
    pipeline(*gmem(b, hkv))


def _dq_kernel(q_ref, do_ref, m_ref, il_ref, delta_ref, k_ref, v_ref, dq_ref,
               q_smem2, do_smem2, m_smem2, il_smem2, delta_smem2, ds_smem2, barriers,
               *, group, head_dim, sk_len, causal, offset, score_scale, scale, interpret):
    b, h, wg = grid_position()
    hkv = lax.div(h, group)
    # Causal: stop after the last key tile any query of this CTA sees.
    cta_queries, n_steps, masked = query_block_keys(WGS * TILE, k_ref.shape[2], TILE, sk_len=sk_len, causal=causal,
                                                    offset=offset, heavy_first_of=q_ref.shape[2] // (WGS * TILE))
    q_start = cta_queries + wg * TILE
    rows = pl.ds(q_start, TILE)

    def compute(pipeline):
        q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
        copies = ((q_ref.at[b, h, rows], q_smem), (do_ref.at[b, rows, h], do_smem),
                  (m_ref.at[b, h, rows], m_smem2.at[wg]), (il_ref.at[b, h, rows], il_smem2.at[wg]),
                  (delta_ref.at[b, h, rows], delta_smem2.at[wg]))
        copy_in(copies, barriers, wg)
        dq = pipeline(wgmma_zeros((TILE, head_dim)))
        do_smem[...] = (dq * scale).astype(do_smem.dtype)  # dO is no longer needed: reuse its SMEM
        copy_out(((do_smem, dq_ref.at[b, rows, h]),))

    def step(idx, k_smem, v_smem, *consumed_and_carry):
        *consumed, dq = consumed_and_carry
        q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
        s, dp = _scores(q_smem, k_smem, do_smem, v_smem, score_scale=score_scale, head_dim=head_dim,
                        fused=not interpret)
        if masked:
            s = mask_scores(s, idx[0] * TILE, q_start, causal=causal, offset=offset, sk_len=sk_len,
                            key_of_column=lane_groups.key_of_column)
        e = _exponentials(s, row_vector(m_smem2.at[wg]), score_scale, head_dim)
        ds = _ds(e, dp, row_vector(il_smem2.at[wg]), row_vector(delta_smem2.at[wg]), k_smem.dtype)
        ds = register_operand(ds, ds_smem2.at[wg] if interpret else None, interpret)
        (dq,) = accumulate((dq,), ((ds, k_smem),), fused=not interpret)
        for barrier in consumed:
            plgpu.barrier_arrive(barrier)
        return dq

    dt = k_ref.dtype
    kv = plgpu.BlockSpec((TILE, head_dim), lambda j: (j, 0), transforms=tile_transforms(dt, head_dim))
    pipeline = compute_pipeline(step, compute, steps=n_steps, compute_wgs=WGS, stages=STAGES, in_specs=[kv, kv])
    pipeline(k_ref.at[b, hkv], v_ref.at[b, hkv])


@functools.partial(jax.jit, static_argnames=("sq_len", "sk_len", "causal", "scale", "naive", "fused_dq",
                                             "lane_ordered", "dq_stage_order", "interpret"))
def qat_attention_bwd_mosaic(qf: jax.Array, kf: jax.Array, vf: jax.Array, o_aux: jax.Array, lse: jax.Array,
                             m: jax.Array, do: jax.Array, *, sq_len: int, sk_len: int, causal: bool, scale: float,
                             naive: bool = False, fused_dq: bool = False, lane_ordered: bool = False,
                             dq_stage_order: str = "auto",
                             interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attn-QAT gradients w.r.t. the fake-quantized operands (= w.r.t. q, k, v by the STE).

    Args and results as :func:`pallas_kernels.qat_bwd.qat_attention_bwd` (no tiles: 64 rows
    per warpgroup): qf (B, Hq, Sq_pad, D); kf, vf (B, Hkv, Sk_pad, D), 16-bit, both
    paddings multiples of 128; o_aux O' (or O when ``naive``) and do (B, Sq, Hq, D) in
    qf's dtype; lse, m float32 (B, Hq, Sq). Returns dq (B, Sq, Hq, D), dk and dv
    (B, Sk, Hkv, D) in do's dtype.

    ``fused_dq``: one kernel for all three gradients — the dK/dV kernel also reduce-adds each
    step's dS·K̃ into a float32 dQ (``reduce_add.reduce_add_matmul``; the order of those additions is not
    fixed, so dQ is not bit-reproducible run to run) — instead of a separate dQ kernel.
    ``lane_ordered``: kf and vf are already in lane order (as :func:`pallas_kernels.qat_fwd_mosaic.
    qat_attention_fwd_mosaic`); dk and dv are returned in key order either way.
    ``dq_stage_order``: the fused dQ's stage column order (``QatConfig.dq_stage_order``, ``dq_stage.permutes``).
    """
    b, hq, sq_pad, d = qf.shape
    hkv = kf.shape[1]
    group = hq // hkv
    dt, f32 = qf.dtype, jnp.float32
    delta, m_rows, inv_l, do_in = backward_rows(o_aux, lse, m, do, seq_pad=sq_pad, dtype=dt, head_major_do=False)
    if not lane_ordered:  # the kernel stores dK and dV back in key order
        kf, vf = lane_groups.to_lane_order(kf, 2), lane_groups.to_lane_order(vf, 2)
    kv_rows = tma_rows(sk_len)

    def kv_grads(dk, dv):
        return trim_rows(dk, sk_len), trim_rows(dv, sk_len)

    common = dict(head_dim=d, sk_len=sk_len, causal=causal, offset=sk_len - sq_len, score_scale=scale * LOG2E,
                  scale=scale, interpret=interpret)
    kv_tiles, p_tiles = wg_tiles(WGS, TILE, dt, d), wg_tiles(WGS, TILE, dt, TILE)
    split = fused_dq and splits_dq_columns(d)
    permuted = fused_dq and dq_stage.permutes(d, interpret, dq_stage_order)  # the dQ stage's column order
    # split: dS double-buffered (the other warpgroup reads it), a (64 × D/2) stage, the CTA-wide barrier
    ds_tiles = plgpu.SMEM((2, WGS, TILE, TILE), dt, transforms=tile_transforms(dt, TILE)) if split else p_tiles
    dkdv_scratch = dict(k_tiles=kv_tiles, v_tiles=kv_tiles, p_tiles=p_tiles, ds_tiles=ds_tiles,
                        barriers=plgpu.Barrier(num_barriers=(2, WGS)))
    dkdv_args = [qf, do_in, m_rows, inv_l, delta, kf, vf]
    kv_blocks = kf.shape[2] // (WGS * TILE)
    if fused_dq:  # a float32 stage per warpgroup and the float32 dQ (one per key block and warpgroup interpreted)
        # (split, a warpgroup's D/2 columns are one REDUCE_COLS-wide stage: split only at head dim 128) and, split,
        # the CTA-wide barrier. The stage may hold its columns permuted (dq_stage.permutes: by default unsplit only)
        dkdv_scratch["dq_stage"] = reduce_add_stage(WGS, TILE)
        if split:
            dkdv_scratch["cta_barrier"] = schedule_barrier()
        # the accumulator as |dO|·0, which XLA computes in the fusion that reads dO for D (no separate fill; a
        # non-finite dO row starts its dQ row as NaN, which that row's dQ would be anyway)
        zeros = jnp.abs(do_in.astype(f32)) * 0.0
        dkdv_args.append(reduce_add_accumulator((b, sq_pad, hq, d), (kv_blocks, WGS), interpret=interpret,
                                                after=do_in, zeros=zeros))
    n_qtiles = sq_pad // TILE
    dk, dv = launch(
        functools.partial(_dkdv_kernel, p=DkdvParams(
            head_dim=d, group=group, n_qtiles=n_qtiles, stages=_dkdv_stages(d), sk_len=sk_len, causal=causal,
            offset=sk_len - sq_len, score_scale=scale * LOG2E, scale=scale, naive=naive, fused_dq=fused_dq,
            split=split, permuted=permuted, interpret=interpret)),
        [jax.ShapeDtypeStruct((b, kv_rows, hkv, d), do.dtype)] * 2, dkdv_scratch, (hkv, kv_blocks, b),
        ("heads", "kv", "batch"),
        name="qat_bwd_dkdv_dq" if fused_dq else "qat_bwd_dkdv",
        compute_wgs=WGS, interpret=interpret, manual_barriers=manual_barriers(d, causal),
    )(*dkdv_args)
    if fused_dq:
        dq = reduce_add_total(dkdv_args[-1], 2, interpret=interpret, permuted=permuted)
        return (dq[:, :sq_len] * scale).astype(do.dtype), *kv_grads(dk, dv)
    row_vecs = plgpu.SMEM((WGS, TILE), f32)
    dq_scratch = [kv_tiles, kv_tiles, row_vecs, row_vecs, row_vecs, p_tiles, plgpu.Barrier(num_barriers=(5, WGS))]
    dq = launch(
        functools.partial(_dq_kernel, group=group, **common),
        jax.ShapeDtypeStruct((b, tma_rows(sq_len), hq, d), do.dtype), dq_scratch,
        (hq, sq_pad // (WGS * TILE), b), ("heads", "q", "batch"), name="qat_bwd_dq", compute_wgs=WGS,
        interpret=interpret,
    )(qf, do_in, m_rows, inv_l, delta, kf, vf)
    return trim_rows(dq, sq_len), *kv_grads(dk, dv)
