"""Attn-QAT backward in Pallas Mosaic GPU (Hopper): the two kernels of :mod:`pallas_kernels.qat_bwd`.

Same numerics as the Triton kernels and ``lowbit_jax.qat_reference.qat_backward_reference``:
S = Q̃K̃ᵀ·scale·log2 e, E = exp2(S − m) with the forward's row max m, P = E·(1/l);
dV += (FQ(E)·(1/l))ᵀdO — FP4 fake quantization in groups of 16 keys per row, relative
to the row max as in the forward, computed as e2m1 · (sf·(1/l)) and for bf16 in bf16 arithmetic
(``lowbit_jax.formats.nvfp4.fake_quant_probabilities``) — or PᵀdO for the naive ablation; dP = dO·Ṽᵀ;
dS = P ∘ (dP − D) rounded to the 16-bit operand dtype; dK += dSᵀQ̃, dQ += dS·K̃, both
times ``scale``. D = rowsum(dO ∘ O'), m and 1/l come from ``qat_reference.backward_rows`` (one
XLA-fused, memory-bound op); the kernels read dO as it is, (B, Sq, Hq, D), by TMA (:data:`DO_NATIVE`).

Both kernels: a memory warpgroup streams tiles through a two-stage TMA pipeline to
two compute warpgroups of 64 rows each, 16-bit ``wgmma`` with fp32 accumulators
updated in place, the two independent products of a step issued together.

* dK/dV: grid (kv head, 128-key block, batch); each warpgroup owns 64 keys and
  loops over the query tiles of every query head of its GQA group. The tiles are
  computed as (queries × keys), with K̃ and Ṽ in lane order (:mod:`pallas_kernels.lane_groups`: each
  thread holds whole FP4 groups of 16 keys; dK and dV go back to key order on their way to SMEM,
  ``stmatrix.store_rows``, instead of by an XLA transpose after the kernel); FQ(P)·(1/l) and dS go
  through SMEM and enter dV and dK as transposed A operands. Where :func:`p_last` says so, dS is stored and
  dK's product (with the fused dQ's) issued before FQ(P) is computed, and dV's product after it, so the
  fake quantization runs while the tensor cores work. There (:func:`manual_barriers`) the kernel is compiled without
  Pallas's automatic warpgroup barriers and places one per step itself, after S and dP are waited for.
* dQ: grid (query head, 128-query block, batch); each warpgroup owns 64 queries and
  loops over key tiles; dS is the register A operand of dS·K̃.
* or dQ fused into the dK/dV kernel (``fused_dq``, ``QatConfig.dq_kernel``): each step's
  dS·K̃ is reduce-added by TMA into a float32 dQ (FlashAttention-3's accumulation,
  ``reduce_add.reduce_add_matmul``); from head dim 128 split by columns between the two warpgroups
  after a CTA-wide barrier (:func:`splits_dq_columns`); at head dim 128 and causal the dQ product is issued
  before dV's and dK's and reduce-added while they run (:func:`dq_first`). The default (faster on the H200 at
  every benchmarked shape since the keys went into lane order).

Causal (bottom-right aligned, Sq ≤ Sk): the dK/dV pipeline starts at the first
query tile that sees the block's keys, the dQ pipeline stops after the last key
tile its queries see (its heaviest query blocks launch first); tiles that reach the diagonal or the ragged key
tail are masked element-wise, the others skip the mask. Not covered (:func:`supports`): head dims other than 64/128,
sequence paddings not a multiple of 128, 32-bit dO, Sq > Sk when causal.
Selected by ``QatConfig.bwd_backend`` "mosaic", or "auto" (the default) on Hopper (fwd+bwd with
both Mosaic kernels: 353 vs 275 TFLOP/s for Triton's at B4 H32 S4096 D128 on the H200, keys in lane
order). FlashAttention-3's ping-pong schedule made these kernels slower (fwd+bwd 293 vs 329 TFLOP/s),
so only the forward has it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from lowbit_jax.qat_reference import backward_rows
from pallas_kernels import dq_stage, lane_groups, stmatrix
from pallas_kernels._mosaic import (
    PingPong, WorkItems, accumulate, compute_pipeline, copy_in, copy_out, first_query_tile, grid_position, group_tile,
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
#: pipeline stages of the dK/dV kernel's query tiles (Q̃, dO, the row vectors) at head dim 64, where SMEM has room
#: for a third: on the H200 (benchmarks/NOTES.md, forty-first session) the kernel 1.936 → 1.911 ms at B8 H32 S2048
#: D64, 0.636 → 0.627–0.630 at B16 H10/5 S2048 D64 causal (two repeats each). At 128 three do not fit.
STAGES_D64 = 3
#: the kernels read dO in its own layout (B, Sq, Hq, D), one head's rows per TMA copy, as the forward writes O,
#: instead of a head-major copy made by an XLA transpose before them: on the H200 fwd+bwd busy time −2.2% at
#: B16 H10/5 S2048 D64 causal, −0.9% at B4 H32 S4096 D128, −1.1% at B8 H32 S2048 D64, the kernels level
#: (benchmarks/NOTES.md, thirty-fourth session)
DO_NATIVE = True
#: up to this head dim keep S unscaled and fold the softmax scale into the exponent (``exp2(s·c − m)``, one FFMA
#: per score), as ``qat_fwd_mosaic.SCALE_IN_EXP``. With the bf16 FQ(P), on the H200 (benchmarks/NOTES.md, fortieth
#: session), this kernel: 0.701 → 0.658 ms at B16 H10/5 S2048 D64 causal, level at B8 H32 S2048 D64; but 3.31 →
#: 3.56 ms at B4 H32 S4096 D128 causal, 12.36 → 13.34 at B1 H32 S16384 D128 causal, 6.08 → 6.10 at B4 H32 S4096 D128
SCALE_IN_EXP_MAX_HEAD_DIM = 64
#: the fused dQ's product is issued before dV's and dK's, and only it is waited for before its TMA reduce-add
#: (``_mosaic.product_first``), instead of waiting for dV and dK first: where :func:`dq_first` says so
DQ_FIRST = True
#: the smallest head dim at which the fused dQ is split by columns between the warpgroups (:func:`splits_dq_columns`)
DQ_SPLIT_MIN_HEAD_DIM = 128
#: the dK/dV kernel issues dK's product (and a first dQ's, :func:`dq_first`) before it computes FQ(P), and dV's after
#: it, so FP4 fake quantization runs while dS's products occupy the tensor cores (``_mosaic.accumulate``'s late
#: operand); off: FQ(P) and dS both before any product, dV's product first. Where: :func:`p_last`
P_LAST = True
#: P_LAST at head dim 64, causal too (off: on the H200 the kernel 0.616 → 0.689 ms at B16 H10/5 S2048 D64 causal)
P_LAST_D64_CAUSAL = False
#: the dK/dV kernel places its own warpgroup barriers (``_mosaic.compiler_params(manual_barriers=True)``): one per
#: step once S and dP are waited for (every warp is then past its wait for the last step's products, whose ``wgmma``
#: read the whole P̃ and dS tiles), none around the stores of P̃ and dS (the ``commit_smem`` that publishes each ends
#: in one), instead of Pallas's bar.sync on both sides of every store to SMEM
MANUAL_BARRIERS = True
#: MANUAL_BARRIERS at head dim 64 causal too, where FQ(P) is not last (off: on the H200 the kernel 0.616 / 0.619 →
#: 0.632 / 0.630 ms at B16 H10/5 S2048 D64 causal; benchmarks/NOTES.md, fifty-third session)
MANUAL_BARRIERS_D64_CAUSAL = False
#: the largest head dim at which the fused dQ's float32 stage holds its columns in ``dq_stage`` order (conflict-free
#: 16-byte stores instead of Mosaic GPU's staggered ones; SageBwd's kernel takes it at 64 too). With this kernel's
#: own barriers, on the H200 (two repeats, benchmarks/NOTES.md, fifty-fourth session) the kernel 1.742 / 1.750 →
#: 1.725 / 1.729 ms at B8 H32 S2048 D64, 0.615 / 0.616 → 0.611 / 0.611 at B16 H10/5 S2048 D64 causal, level at B8
#: H32 S2048 D64 causal (the forty-fourth session, before them, had measured it mixed: +2.3% at the first)
PERMUTED_STAGE_MAX_HEAD_DIM = 64
#: the fused dQ's float32 accumulator starts as |dO|·0 instead of a separate zero fill: XLA writes it in the pass
#: that reads dO for D = rowsum(dO ∘ O′) (one multi-output fusion, one launch fewer). On the H200 (two repeats,
#: benchmarks/NOTES.md, fifty-fourth session) fwd+bwd 3.030 / 3.025 → 3.011 / 2.991 ms at B8 H32 S2048 D64, D and
#: fill 0.079 → 0.068 ms; level at B4 H32 S4096 D128 and B16 H10/5 S2048 D64 causal. A row of dO with an inf or NaN
#: starts its dQ row as NaN, which that row's dQ would be anyway
ZEROS_FROM_DO = True
#: FQ(P) with explicit packed fma (``lane_groups.fake_quant_p(fma=True)``, as ``qat_fwd_mosaic.EXPLICIT_FMA``): off.
#: The hot loop has 626 → 610 SASS instructions per thread and step at B8 H32 S2048 D64, but on the H200 (two repeats,
#: benchmarks/NOTES.md, fifty-sixth session) this kernel 1.710 / 1.711 → 1.734 / 1.742 ms there, 0.603 / 0.606 →
#: 0.611 / 0.614 at B16 H10/5 S2048 D64 causal, 5.47 / 5.54 → 5.57 / 5.51 at B4 H32 S4096 D128
EXPLICIT_FMA = False
#: FQ(P)'s group scales as ``qat_fwd_mosaic.FAST_SCALE``: off. The hot loop has 610 → 601 SASS instructions per thread
#: and step at B8 H32 S2048 D64, but on the H200 (two repeats, benchmarks/NOTES.md, fifty-seventh session) this kernel
#: 1.725 / 1.726 → 1.740 / 1.755 ms there, 0.600 / 0.601 → 0.603 / 0.604 at B16 H10/5 S2048 D64 causal, 5.42 / 5.46 →
#: 5.50 / 5.48 at B4 H32 S4096 D128, 3.06 / 3.02 → 3.02 / 3.00 at B4 H32 S4096 D128 causal (as with EXPLICIT_FMA:
#: fewer instructions, slower at three of four shapes)
FAST_SCALE = False
#: probe, not yet timed: FQ(P)'s bit operation as ``qat_fwd_mosaic.PACKED_LOP3``
PACKED_LOP3 = False


def permutes_dq_stage(head_dim: int, interpret: bool) -> bool:
    """Whether the fused dQ's stage holds its columns in ``dq_stage`` order: one REDUCE_COLS-wide stage per
    warpgroup (head dim 64, unsplit) up to :data:`PERMUTED_STAGE_MAX_HEAD_DIM`, where ``dq_stage.in_use``."""
    return dq_stage.permutes(head_dim, min(PERMUTED_STAGE_MAX_HEAD_DIM, REDUCE_COLS), interpret)


def manual_barriers(head_dim: int, causal: bool) -> bool:
    """Whether the dK/dV kernel places its own warpgroup barriers (:data:`MANUAL_BARRIERS`): where :func:`p_last`
    holds (head dim 128, and 64 non-causal)."""
    return MANUAL_BARRIERS and (p_last(head_dim, causal) or MANUAL_BARRIERS_D64_CAUSAL)


def splits_dq_columns(head_dim: int) -> bool:
    """Whether the fused dQ of :func:`qat_attention_bwd_mosaic` is split by columns between the two warpgroups.

    Split: after one CTA-wide barrier per step both warpgroups' dS tiles are in SMEM, and warpgroup w
    reduce-adds dQ's columns w·D/2… summed over the CTA's 128 keys (Σ_w dS_w·K̃_w[:, cols], one
    accumulator), instead of each adding all D columns over its own 64 keys: half the TMA reduce traffic,
    the warpgroups held in step. On the H200 (benchmarks/NOTES.md, sixteenth session), fwd+bwd at D128:
    B4 H32 S4096 12.25 → 11.70 ms non-causal and 6.71 → 6.12 causal. At head dim 64 it was slower
    (4.03 → 4.30 ms at B8 H32 S2048, with Q̃, K̃ and dS in a 64-byte swizzle so that a 32-column half of
    K̃ is a ``wgmma`` operand); here a column half of K̃ spans whole 128-byte swizzle rows only from 128.
    """
    return head_dim >= max(DQ_SPLIT_MIN_HEAD_DIM, 2 * REDUCE_COLS)


def supports(*, sq_len: int, sk_len: int, sq_pad: int, sk_pad: int, head_dim: int, causal: bool, dtype,
             do_dtype) -> bool:
    """Whether the Mosaic backward covers this call (else the Triton kernels run)."""
    sixteen_bit = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return (head_dim in (64, 128) and sq_pad % (WGS * TILE) == 0 and sk_pad % (WGS * TILE) == 0
            and jnp.dtype(dtype) in sixteen_bit and jnp.dtype(do_dtype) == jnp.dtype(dtype)
            and (not causal or sq_len <= sk_len))


def dq_first(head_dim: int, causal: bool) -> bool:
    """Whether the fused dQ's product goes first (:data:`DQ_FIRST`): with the column split (head dim 128), and
    causal at head dim 64. On the H200 (benchmarks/NOTES.md, forty-first session) the dK/dV/dQ kernel: 0.664 →
    0.633 ms at B16 H10/5 S2048 D64 causal, 6.07 → 5.94 at B4 H32 S4096 D128, 3.31 → 3.22 causal; fwd+bwd 2.06 →
    1.99 ms at B8 H32 S2048 D64 causal, 18.55 → 18.36 at B1 H32 S16384 D128 causal. But non-causal at head dim 64
    slower: the kernel 1.94 → 2.06 ms at B8 H32 S2048, fwd+bwd 2.14 → 2.16 at B16 H10/5 S2048 (as the
    SageAttention kernel's one wait for its three products, ``sage_bwd_mosaic.DQ_WITH_DKDV_CAUSAL``) — unless FQ(P)
    comes last (:func:`p_last`): then dQ's product first runs under FQ(P) with dK's, and at B8 H32 S2048 D64 the
    kernel took 1.88 / 1.87 ms against 1.95 / 1.93 with dQ after (fifty-second session)."""
    return DQ_FIRST and (causal or splits_dq_columns(head_dim) or p_last(head_dim, causal))


def p_last(head_dim: int, causal: bool) -> bool:
    """Whether the dK/dV kernel computes FQ(P) after dS's products are issued (:data:`P_LAST`): at head dim 128, and
    at 64 non-causal (there with the fused dQ's product first, :func:`dq_first`). On the H200 (benchmarks/NOTES.md,
    fifty-second session) the fused kernel: 6.03 / 6.05 → 5.76 / 5.72 ms at B4 H32 S4096 D128, 3.18 / 3.19 → 3.02 /
    3.03 causal, 1.91 / 1.92 → 1.88 / 1.87 at B8 H32 S2048 D64 (1.95 / 1.93 without dQ first); but 0.616 → 0.689 at
    B16 H10/5 S2048 D64 causal (:data:`P_LAST_D64_CAUSAL`)."""
    return P_LAST and (head_dim > 64 or not causal or P_LAST_D64_CAUSAL)


def scale_in_exp(head_dim: int) -> bool:
    """Whether the kernels fold the softmax scale into the exponent (:data:`SCALE_IN_EXP_MAX_HEAD_DIM`)."""
    return head_dim <= SCALE_IN_EXP_MAX_HEAD_DIM


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


def _dkdv_kernel(q_ref, do_ref, m_ref, il_ref, delta_ref, k_ref, v_ref, *refs, items, group, n_qtiles, head_dim,
                 sk_len, causal, offset, score_scale, scale, naive, interpret, fused_dq, split, permuted, do_native):
    """dK, dV; if ``fused_dq`` also dQ, reduce-added into the float32 ``dq_ref``
    (``reduce_add.reduce_add_matmul``); ``split``: by columns between the warpgroups (:func:`splits_dq_columns`);
    ``permuted``: the dQ stage's columns in ``dq_stage`` order (:func:`permutes_dq_stage`).
    ``refs``: [dq_ref], dk_ref, dv_ref, then the scratch [, stage2[, cta_barrier]]."""
    if fused_dq:
        dq_ref, dk_ref, dv_ref, k_smem2, v_smem2, p_smem2, ds_smem2, barriers, stage2, *cta_barrier = refs
        cta_barrier = cta_barrier[0] if split else None
    else:
        dk_ref, dv_ref, k_smem2, v_smem2, p_smem2, ds_smem2, barriers = refs
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
        do_tile = tile
        if do_native:  # dO (B, Sq_pad, Hq, D): a tile is TILE rows of one head, read by TMA with the head's stride
            do_tile = plgpu.BlockSpec((TILE, None, head_dim),
                                      lambda i: (head_and_tile(i)[1], head_and_tile(i)[0], 0),
                                      transforms=tile_transforms(dt, head_dim))
        return [tile, do_tile, vec, vec, vec]

    def gmem(b, hkv):  # the pipeline's arrays for the query heads of kv head hkv
        heads = pl.ds(hkv * group, group)
        do_heads = do_ref.at[b, :, heads] if do_native else do_ref.at[b, heads]
        return q_ref.at[b, heads], do_heads, m_ref.at[b, heads], il_ref.at[b, heads], delta_ref.at[b, heads]

    def item(pos, state, allocations):  # one (kv head, 128-key block, batch) work item (_mosaic.WorkItems)
        b, hkv, _ = grid_position(pos)
        kv_block = pos["kv"]
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
                if lane_groups.ENABLED:
                    stmatrix.store_rows(smem, acc.astype(smem.dtype), interpret, key_of_row=lane_groups.key_of_column,
                                        from_order=lane_groups.from_lane_order)
                else:
                    smem[...] = acc.astype(smem.dtype)
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
                                key_of_column=lane_groups.key_order())
            e = _exponentials(s, row_vector(m_smem), score_scale, head_dim)  # row max 1: FQ relative to it
            il_row = row_vector(il_smem)
            inv_l = rows_of(il_row, s.shape)

            def p_operand():  # P̃·(1/l) = e2m1 · (sf·(1/l)) (the scale product once per FP4 group) → dV's A operand
                p_smem[...] = ((e * inv_l).astype(dt) if naive
                               else lane_groups.fake_quant_p(e, interpret, times=inv_l, dtype=dt, fma=EXPLICIT_FMA,
                                                             lop3=PACKED_LOP3, fast_scale=FAST_SCALE))
                return p_smem.T, do_smem

            def late_p_operand():  # after dS's products are issued (P_LAST)
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
                # after dV and dK, freeing it early measured slower: benchmarks/NOTES.md, forty-second session)
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

        pipeline = compute_pipeline(step, compute, steps=group * n_vis, compute_wgs=WGS, stages=items.stages,
                                    in_specs=in_specs(head_and_tile), state=state)
        pipeline(*gmem(b, hkv), allocations=allocations)

    # persistent (not causal): every item's pipeline runs over all query tiles of the group's heads
    items.run(item, in_specs(functools.partial(group_tile, n_tiles=n_qtiles)), gmem(0, 0), compute_wgs=WGS)


def _dq_kernel(q_ref, do_ref, m_ref, il_ref, delta_ref, k_ref, v_ref, dq_ref,
               q_smem2, do_smem2, m_smem2, il_smem2, delta_smem2, ds_smem2, barriers,
               *, group, head_dim, sk_len, causal, offset, score_scale, scale, interpret, do_native):
    b, h, wg = grid_position()
    hkv = lax.div(h, group)
    # Causal: stop after the last key tile any query of this CTA sees.
    cta_queries, n_steps, masked = query_block_keys(WGS * TILE, k_ref.shape[2], TILE, sk_len=sk_len, causal=causal,
                                                    offset=offset, heavy_first_of=q_ref.shape[2] // (WGS * TILE))
    q_start = cta_queries + wg * TILE
    rows = pl.ds(q_start, TILE)

    def compute(pipeline):
        q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
        do_rows = do_ref.at[b, rows, h] if do_native else do_ref.at[b, h, rows]
        copies = ((q_ref.at[b, h, rows], q_smem), (do_rows, do_smem),
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
                            key_of_column=lane_groups.key_order())
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
                                             "lane_ordered", "interpret"))
def qat_attention_bwd_mosaic(qf: jax.Array, kf: jax.Array, vf: jax.Array, o_aux: jax.Array, lse: jax.Array,
                             m: jax.Array, do: jax.Array, *, sq_len: int, sk_len: int, causal: bool, scale: float,
                             naive: bool = False, fused_dq: bool = False, lane_ordered: bool = False,
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
    """
    b, hq, sq_pad, d = qf.shape
    hkv = kf.shape[1]
    group = hq // hkv
    dt, f32 = qf.dtype, jnp.float32
    delta, m_rows, inv_l, do_in = backward_rows(o_aux, lse, m, do, seq_pad=sq_pad, dtype=dt,
                                               head_major_do=not DO_NATIVE)
    if lane_groups.ENABLED and not lane_ordered:  # the kernel stores dK and dV back in key order
        kf, vf = lane_groups.to_lane_order(kf, 2), lane_groups.to_lane_order(vf, 2)
    kv_rows = tma_rows(sk_len)

    def kv_grads(dk, dv):
        return trim_rows(dk, sk_len), trim_rows(dv, sk_len)

    common = dict(head_dim=d, sk_len=sk_len, causal=causal, offset=sk_len - sq_len, score_scale=scale * LOG2E,
                  scale=scale, interpret=interpret, do_native=DO_NATIVE)
    kv_tiles, p_tiles = wg_tiles(WGS, TILE, dt, d), wg_tiles(WGS, TILE, dt, TILE)
    split = fused_dq and splits_dq_columns(d)
    permuted = fused_dq and not split and permutes_dq_stage(d, interpret)  # the dQ stage's column order
    # split: dS double-buffered (the other warpgroup reads it), a (64 × D/2) stage, the CTA-wide barrier
    ds_tiles = plgpu.SMEM((2, WGS, TILE, TILE), dt, transforms=tile_transforms(dt, TILE)) if split else p_tiles
    dkdv_scratch = [kv_tiles, kv_tiles, p_tiles, ds_tiles, plgpu.Barrier(num_barriers=(2, WGS))]
    dkdv_args = [qf, do_in, m_rows, inv_l, delta, kf, vf]
    kv_blocks = kf.shape[2] // (WGS * TILE)
    if fused_dq:  # a float32 stage per warpgroup and the float32 dQ (one per key block and warpgroup interpreted)
        # (split, a warpgroup's D/2 columns are one REDUCE_COLS-wide stage: split only at head dim 128) and, split,
        # the CTA-wide barrier. Unsplit (head dim 64) the stage may hold its columns permuted
        # (:func:`permutes_dq_stage`)
        dkdv_scratch += [reduce_add_stage(WGS, TILE), *([schedule_barrier()] if split else [])]
        # ZEROS_FROM_DO: |dO|·0 (dO as the kernel reads it, (B, Sq_pad, Hq, D)), which XLA may compute in the fusion
        # that reads dO for D
        zeros = jnp.abs(do_in.astype(f32)) * 0.0 if ZEROS_FROM_DO and DO_NATIVE else None
        dkdv_args.append(reduce_add_accumulator((b, sq_pad, hq, d), (kv_blocks, WGS), interpret=interpret,
                                                after=do_in, zeros=zeros))
    n_qtiles = sq_pad // TILE
    items = WorkItems.plan((hkv, kv_blocks, b), ("heads", "kv", "batch"), steps=group * n_qtiles,
                           stages=STAGES_D64 if d <= 64 else STAGES, causal=causal, interpret=interpret)
    dk, dv = launch(
        functools.partial(_dkdv_kernel, items=items, group=group, n_qtiles=n_qtiles, naive=naive, fused_dq=fused_dq,
                          split=split, permuted=permuted, **common),
        [jax.ShapeDtypeStruct((b, kv_rows, hkv, d), do.dtype)] * 2, dkdv_scratch, items, None,
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
