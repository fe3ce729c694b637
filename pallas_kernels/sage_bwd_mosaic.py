"""SageBwd on Hopper: the INT8 attention backward in Pallas Mosaic GPU.

Same numerics as :mod:`pallas_kernels.sage_bwd` (the Triton kernels) and as the
pure-JAX reference: the same residuals, the same per-tile dS quantization, the
same P quantization per key row; only the execution differs. Each kernel is
warp-specialised: a memory warpgroup streams tiles with TMA into a two-stage
SMEM pipeline while two compute warpgroups each own one 64-row tile and issue
``wgmma`` (INT8×INT8→INT32 for QKᵀ, dV, dK and dQ; 16-bit only for dP).

* ``sage_bwd_dkdv_mosaic`` — grid (kv head, 128-key block, batch); each compute
  warpgroup holds a 64-key tile of K̂ and Ṽ and loops over every query tile of
  every query head of its GQA group: Sᵀ = K̂Q̂ᵀ, Pᵀ = exp2(Sᵀ − L),
  dV += P̂ᵀdÔ, dPᵀ = ṼdOᵀ, dSᵀ = Pᵀ∘(dPᵀ − D), dK += dŜᵀQ̂.
* ``sage_bwd_dq_mosaic`` — grid (query head, 128-query block, batch); each
  compute warpgroup holds a 64-query tile and loops over the 64-key tiles:
  S, P, dP, dS as above, dQ += dŜK̂.
* or dQ fused into ``sage_bwd_dkdv_mosaic`` (``k8_t=``; ``SageFwdConfig.dq_kernel``): the
  per-tile dŜ is also stored transposed and each step's dŜK̂ is reduce-added by TMA into a
  float32 dQ (FlashAttention-3's accumulation, ``reduce_add.reduce_add_matmul``): the default
  (``SageFwdConfig.fuses_dq``; fwd+bwd 23% less time on the H200 at head dim 64, 11% at 128
  non-causal, 3–7% at 128 causal). Its K̂ and Ṽ rows are in :mod:`pallas_kernels.key_pairs`
  order, so the transposed copy is two ``stmatrix.trans`` per thread and step instead of a
  relayout through WGMMA_TRANSPOSED (hot loop 1146 → 1038 instructions per thread and step at
  B16 H10/5 S2048 D64 causal; fwd+bwd 7% less time there, 4% at B8 H32 S2048 D64, 1–3% at
  B4 H32 S4096 D128; benchmarks/NOTES.md, thirty-first session); dK and dV leave in natural order.
  At head dim 128 dQ's two 64-column chunks each have their own float32 stage (:data:`DQ_STAGE_PER_CHUNK`:
  the kernel 2.8% faster at B4 H32 S4096 D128, 6% causal), and a stage is freed while the step's products run
  (``reduce_add.early_stage_wait``; forty-second session). At head dim 64 the stage holds its columns permuted
  (:mod:`pallas_kernels.dq_stage`: 16-byte stores without bank conflicts instead of Mosaic GPU's staggered ones; the
  kernel 2.3% faster at B16 H10/5 S2048 D64 causal, 7.5% at B8 H32 S2048 D64; forty-fourth session).

The INT8 A operands P̂ᵀ and dŜᵀ (dK/dV kernel) and dŜ (dQ kernel) are taken straight from
registers instead of through SMEM and a warpgroup barrier. The dK/dV kernel is given Q̂ᵀ and dÔᵀ with
their queries in :mod:`pallas_kernels.operand_order` (``sage_quantize_q``, ``sage_bwd_preprocess``), so
P̂ᵀ's and dŜᵀ's registers are the operands as they are (``operand_order.register_operand``; the fused
kernel 3.5% faster at B16 H10/5 S2048 D64 causal, 6% at B8 H32 S2048 D64, 7% at B4 H32 S4096 D128 on the
H200, benchmarks/NOTES.md, thirty-second session); otherwise (and in the dQ kernel)
``register_operands.register_operand`` relays them out by two lane shuffles per 4 values. Registers rather
than SMEM: fwd+bwd 7% less time at B4 H32 S4096 D128 on the H200, causal too (fourteenth session);
at head dim 64, where SMEM had measured 1–3% faster, registers are 2–3.5% faster since the per-step
scale reads were cut (B8 H32 S2048, B16 H10/5 S2048 causal; ``REGISTER_P_MIN_HEAD_DIM``,
``REGISTER_DS_MIN_HEAD_DIM``; benchmarks/NOTES.md, twentieth session). The fused dQ's dŜ (queries × keys)
is a transposed copy and always goes through SMEM.
Independent products of a step are issued before one wait: Sᵀ with dPᵀ, and (at head dim
64) dV with dK — causal, with the fused dQ, dQ's dŜK̂ as well — after one barrier for both P̂
and dŜ; S with dP in the dQ kernel. At head dim 128 dV and dK are waited for one at a time:
two (64 × 128) INT32 products beside the dK and dV accumulators exceed the compute
warpgroups' 232 registers (ptxas spilled 400–590 bytes with dV issued beside dPᵀ; this order
cut the D128 kernel from 7.13 to 6.27 ms at B4 H32 S4096 on the H200, benchmarks/NOTES.md,
eleventh session). The Mosaic GPU interpreter runs the products one at a time
(``matmuls(fused=False)``, same values).

Causal (bottom-right aligned, Sq ≤ Sk): the dK/dV kernel starts at the first query
tile that sees its keys and the dQ kernel stops after the last key tile its queries
see (dynamic pipeline lengths; its heaviest query blocks launch first — no measurable
change on the H200); tiles that reach the diagonal are masked element-wise, the others skip the mask
(``_mosaic.mask_scores``).

Supported here: no Q-smoothing, head dim 64 or 128, 64×64 backward tiles, no key
padding (:func:`supports`). ``lowbit_jax.sage`` picks the backend of
each kernel (``SageFwdConfig.dkdv_backend`` / ``dq_backend``) and uses the Triton
kernel where this one does not apply. The preprocess (D, INT8 dOᵀ) is the Triton one.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from lowbit_jax.formats import int8
from lowbit_jax.formats.sage_tiles import dequantize_v_t
from pallas_kernels import dq_stage, key_pairs, operand_order
from pallas_kernels._mosaic import (
    WorkItems, col_vector, cols_of, compute_pipeline, copy_in, copy_out, first_query_tile, grid_position, group_tile,
    guarded_step, key_step_specs, launch, mask_scores, matmul, matmuls, pad_rows, pl, plgpu, query_block_keys,
    row_vector, rows_of, scalar, tile_transforms, tma_rows, transposed_step_spec, trim_rows, wg_tiles, wgmma_zeros,
)
from pallas_kernels.configs import SageFwdConfig
from pallas_kernels.reduce_add import (
    REDUCE_COLS, early_stage_wait, reduce_add_accumulator, reduce_add_matmul, reduce_add_product, reduce_add_slot,
    reduce_add_stage, reduce_add_total,
)
from pallas_kernels.register_operands import int8_operand_in_smem, register_operand
from pallas_kernels.warp_reduce import tile_absmax

LOG2E = math.log2(math.e)
TILE = 64  # rows per compute warpgroup, and the pipelined tile
WGS = 2  # compute warpgroups per CTA
STAGES = 2
#: pipeline stages of the fused dK/dV(/dQ) kernel's query tiles at head dim 64, where SMEM has room for a third: on
#: the H200 (benchmarks/NOTES.md, forty-first session) the kernel 0.680 / 0.677 → 0.670 / 0.669 ms at B16 H10/5
#: S2048 D64 causal, 1.118 / 1.112 → 1.104 / 1.102 at B8 H32 S2048 D64 causal (two repeats); not timed non-causal
STAGES_D64 = 3
#: causal, head dim 64, fused dQ: issue dQ's dŜK̂ together with dV and dK, one wait for the three (on the
#: H200 fwd+bwd 3% faster at B16 H10/5 S2048 causal, 2% at B8 H32 S2048 causal, but 2.4% slower
#: non-causal at B8 H32 S2048, where dQ keeps its own wait; benchmarks/NOTES.md, twelfth session)
DQ_WITH_DKDV_CAUSAL = True
#: the smallest head dim at which P̂ᵀ (dV's A operand) and dŜ (dK's and the dQ kernel's) are taken straight
#: from registers (``register_operands.register_operand``) instead of through SMEM (see the module docstring)
REGISTER_P_MIN_HEAD_DIM = 64
REGISTER_DS_MIN_HEAD_DIM = 64
#: the dK/dV kernel's Q̂ᵀ and dÔᵀ (the B operands of dK += dŜᵀQ̂, dV += P̂ᵀdÔ) with their queries in
#: :mod:`pallas_kernels.operand_order`, so P̂ᵀ and dŜᵀ are A operands as the registers hold them
OPERAND_ORDER = True
#: probe, off: causal, a dK/dV warpgroup skips the query tiles that see none of its 64 keys. A CTA starts at the
#: first query tile that sees its *first* key, one tile before the second warpgroup's first (per query head of the
#: group); the skipped step would add exact zeros to dK, dV and dQ (P = 0, so P̂ = dŜ = 0). 3% of the warpgroups'
#: steps at Sq = Sk = 2048 (:func:`needed_query_tile`), but on the H200 the fused kernel did not get faster (0.6844 /
#: 0.6848 vs 0.6828 / 0.6839 ms at B16 H10/5 S2048 D64 causal, 1.1215 / 1.1294 vs 1.1229 / 1.1225 at B8 H32 S2048
#: D64 causal; the forward's twin, ``sage_fwd_mosaic.SKIP_EMPTY_STEPS``, gained 5–6%; benchmarks/NOTES.md,
#: thirty-seventh session): a CTA's two warpgroups meet at the pipeline's barriers every step, so the one that skips
#: waits for the other.
SKIP_EMPTY_STEPS = False
#: at head dim 128 the fused dQ's two column chunks each have their own float32 stage (reduce_add.reduce_add_stage), so
#: the second chunk's stage does not wait for the first chunk's TMA reduce-add (just issued) to have read it
DQ_STAGE_PER_CHUNK = True
#: the smallest head dim at which the fused dQ's stage is freed while its own product runs where that product is
#: issued after dV's and dK's wait (D128, and D64 non-causal; ``reduce_add.early_stage_wait``): at D128 the kernel 1.3%
#: faster at B4 H32 S4096 (forty-second session); at D64 non-causal 2.4% slower at B8 H32 S2048 (forty-third)
EARLY_FREE_MIN_HEAD_DIM = 128
#: the largest head dim at which the fused dQ's float32 stage holds its columns in ``dq_stage`` order (conflict-free
#: 16-byte stores instead of Mosaic GPU's staggered 8-byte ones): on the H200 the kernel 0.664 → 0.649 ms at B16 H10/5
#: S2048 D64 causal, 2.126 → 1.965 at B8 H32 S2048 D64 (two repeats each); at D128 slower (B4 H32 S4096 causal
#: 2.95 → 4.09 ms, non-causal 5.74 → 5.90; benchmarks/NOTES.md, forty-fourth session). Why: at D128 causal ptxas
#: spills 272 bytes with it (176-byte stack frame) against 52 (24) without (``variants.py --ptxas``, forty-sixth
#: session: fwd+bwd 4.66 → 5.80 ms)
PERMUTED_STAGE_MAX_HEAD_DIM = 64
#: the fused kernel's K̂ and Ṽ put in pair order by one Triton pass (``sage_bwd.sage_bwd_kv_operands``, which
#: also dequantizes Ṽ) instead of XLA's transposes (:func:`takes_pair_ordered_inputs`)
KV_OPERANDS_KERNEL = True
#: the fused dK/dV/dQ kernel is compiled without Pallas's automatic barriers (``_mosaic.compiler_params(
#: manual_barriers=True)``): its step already orders every rewrite of an SMEM tile by barriers of its own (the dQ
#: stage's free, each ``commit_smem``, the one inside ``warp_reduce._warp_absmax``), so Pallas's bar.sync on both sides
#: of the float32 dQ stage's store (head dim 128, where that store is a plain one) and before each of the memory
#: warpgroup's TMA loads only wait (:func:`manual_barriers`). On the H200 (two repeats, benchmarks/NOTES.md,
#: fifty-fourth session) the kernel 1.761 / 1.761 → 1.742 / 1.742 ms at B8 H32 S2048 D64, 0.621 / 0.618 → 0.613 /
#: 0.611 at B16 H10/5 S2048 D64 causal; at head dim 128 5.631 / 5.638 → 5.614 / 5.622 at B4 H32 S4096 (level) and
#: 2.984 / 2.987 → 3.011 / 3.040 causal, so up to :data:`MANUAL_BARRIERS_MAX_HEAD_DIM`
MANUAL_BARRIERS = True
MANUAL_BARRIERS_MAX_HEAD_DIM = 64
#: probe, not yet timed: causal, mask the scores before their scale (Q and K scales, a positive factor: −inf stays
#: −inf, every other value is the same product), so the scale's multiply and the exponent's subtraction of the LSE
#: meet after the mask's branch and ptxas can contract them into one FFMA, as it does in the non-causal kernels.
#: The SASS census of the fused kernel at B16 H10/5 S2048 D64 causal (forty-sixth session) had 32 ``FMUL`` (s·c)
#: and 32 ``FADD`` (− L) per thread and step there, before the branch and after it; this would make them 32 ``FFMA``
#: and take one dependent instruction off the chain from S to the exponentials. Interpreted, XLA's CPU code contracts
#: them too: P moves by float32 rounding, which flips an INT8 code of P̂ or dŜ here and there (gradients within
#: rel-L1 2e-6); ``benchmarks/NOTES.md``, fifty-eighth session, has the command that times it.
MASK_RAW_SCORES = False


def _smem_operands(head_dim: int, interpret: bool) -> tuple[bool, bool]:
    """Whether P̂ᵀ and dŜ (the INT8 A operands of dV, dK and the dQ kernel's dŜK̂) need SMEM tiles: not
    where ``register_operands.register_operand`` takes them from registers (from ``REGISTER_*_MIN_HEAD_DIM``,
    compiled, with the relayout available), so those kernels do not allocate them."""
    return (int8_operand_in_smem(interpret, head_dim >= REGISTER_P_MIN_HEAD_DIM),
            int8_operand_in_smem(interpret, head_dim >= REGISTER_DS_MIN_HEAD_DIM))


def takes_operand_order(head_dim: int, interpret: bool) -> bool:
    """Whether the dK/dV kernel should be given Q̂ᵀ and dÔᵀ in operand order: ``OPERAND_ORDER``,
    ``operand_order.available`` and both INT8 A operands from registers at this head dim."""
    return (OPERAND_ORDER and operand_order.available(interpret)
            and head_dim >= max(REGISTER_P_MIN_HEAD_DIM, REGISTER_DS_MIN_HEAD_DIM))


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


def permutes_dq_stage(head_dim: int, interpret: bool) -> bool:
    """Whether the fused dQ's stage holds its columns in ``dq_stage`` order: up to
    :data:`PERMUTED_STAGE_MAX_HEAD_DIM`, where ``dq_stage.in_use`` (compiled)."""
    return dq_stage.permutes(head_dim, PERMUTED_STAGE_MAX_HEAD_DIM, interpret)


def takes_pair_ordered_inputs(*, fused_dq: bool) -> bool:
    """Whether :func:`sage_bwd_dkdv_mosaic` should be given K̂ and Ṽ already in :mod:`pallas_kernels.key_pairs`
    order (``keys_in_pair_order=True``): with the fused dQ, pair order on (``key_pairs.ENABLED``) and
    ``KV_OPERANDS_KERNEL``."""
    return fused_dq and key_pairs.ENABLED and KV_OPERANDS_KERNEL


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
    rows (XLA fuses that into the dequantization; permuting the INT8 codes' columns instead was a separate
    transpose, 0.29 ms at B4 H32 S4096 D128 on the H200, benchmarks/NOTES.md).
    """
    vd = jnp.swapaxes(dequantize_v_t(vt8, v_scale, dtype), 2, 3)
    return operand_order.from_operand_order(vd, 2) if keys_in_operand_order else vd


def manual_barriers(head_dim: int, *, fused_dq: bool, interpret: bool) -> bool:
    """Whether :func:`sage_bwd_dkdv_mosaic` is compiled without Pallas's automatic barriers
    (:data:`MANUAL_BARRIERS`): up to :data:`MANUAL_BARRIERS_MAX_HEAD_DIM`, with the fused dQ, compiled, and both
    INT8 A operands (P̂ᵀ, dŜᵀ) from registers (:func:`_smem_operands`), where every SMEM tile the step rewrites is
    already ordered by a barrier it places:

    * the transposed dŜ (``stmatrix``, never behind one of Pallas's barriers) is last read by the previous step's
      dQ product, which every warp waits for before that step's last ``commit_smem``;
    * the tile maximum's four words (``warp_reduce.tile_absmax``) are read before the step's ``commit_smem``;
    * the float32 dQ stage is rewritten after its free (``cp.async.bulk.wait_group.read`` and a barrier) and
      published by ``commit_smem``;
    * the epilogue writes dK and dV into the Ṽ tile after ``wait_smem_to_gmem`` (a barrier) and commits them.
    """
    return (MANUAL_BARRIERS and head_dim <= MANUAL_BARRIERS_MAX_HEAD_DIM and fused_dq and not interpret
            and not any(_smem_operands(head_dim, interpret)))


def needed_query_tile(tile: jax.Array, wg_keys: jax.Array, *, offset: int) -> jax.Array:
    """Causal (bottom-right aligned): whether query tile ``tile`` (64 rows) sees any of the 64 keys from
    ``wg_keys`` on, i.e. its last row's diagonal reaches the first of them."""
    return wg_keys <= tile * TILE + (TILE - 1) + offset


def _skipped_step(carry):
    """A dK/dV step :func:`needed_query_tile` rules out: the dK, dV accumulators as they are."""
    return carry


def _ds_quantize(x: jax.Array, scratch, per_row: bool, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """ψ of a dS tile, codes rounded half to even (``int8.encode_half_even``): one scale for the whole tile
    (a scalar) or, ``per_row``, one per row (over axis 1; a row vector, no cross-warp reduction)."""
    if per_row:
        return int8.quantize_half_even(x, 1, truncating_convert=True, broadcast=lambda v: rows_of(v, x.shape))
    scale = int8.scale_from_amax(tile_absmax(x, scratch, interpret))
    return int8.encode_half_even(x, scale, truncating_convert=True), scale


# ----------------------------------------------------------------------------- dK, dV


def _dkdv_kernel(q_ref, qs_ref, qt_ref, lse_ref, delta_ref, do_ref, dot_ref, dosc_ref, k_ref, ks_ref, vd_ref,
                 *refs, items, group, n_qtiles, per_block, head_dim, fused, causal, offset, ds_per_row, fused_dq, pairs,
                 operand, scale, permuted, interpret):
    """dK, dV; if ``fused_dq`` also dQ, reduce-added into the float32 ``dq_ref``
    (``reduce_add.reduce_add_matmul``). ``pairs``: K̂ and Ṽ rows in :mod:`pallas_kernels.key_pairs` order (the
    transposed dŜ and the dK, dV tiles stored by ``stmatrix``; dK and dV leave in natural key order).
    ``permuted``: the dQ stage's columns in ``dq_stage`` order (:func:`permutes_dq_stage`).
    ``refs``: [kt_ref, dq_ref], dk_ref, dv_ref, then the scratch: K̂, Ṽ, K scales[, dK], [P̂ᵀ], [dŜᵀ]
    (:func:`_smem_operands`), the row-maximum vectors, the barriers[, K̂ᵀ, dŜ, the dQ stage]."""
    refs = list(refs)
    take = lambda n=1: [refs.pop(0) for _ in range(n)]  # noqa: E731
    kt_ref, dq_ref = take(2) if fused_dq else (None, None)
    dk_ref, dv_ref, k_smem2, vd_smem2, ks_smem2 = take(5)
    dk_smem2 = None if fused_dq else take()[0]
    smem_p, smem_ds = _smem_operands(head_dim, interpret)
    p_smem2 = take()[0] if smem_p else None
    ds_smem2 = take()[0] if smem_ds else None
    red_smem2, barriers = take(2)
    kt_smem2, dsq_smem2, stage2 = take(3) if fused_dq else (None,) * 3
    wg = lax.axis_index("wg")
    shape = (TILE, TILE)  # (keys, queries)
    p_in_registers, ds_in_registers = head_dim >= REGISTER_P_MIN_HEAD_DIM, head_dim >= REGISTER_DS_MIN_HEAD_DIM
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

    def item(pos, state, allocations):  # one (kv head, 128-key block, batch) work item (_mosaic.WorkItems)
        b, hkv, _ = grid_position(pos)
        kv_block = pos["kv"]
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
                plgpu.wait_smem_to_gmem(0)  # the last dQ copy is done
                for acc, out_ref in ((dk, dk_ref), (dv, dv_ref)):
                    if pairs:  # back to natural key order on the way to SMEM
                        key_pairs.store_rows(vd_smem, acc.astype(vd_smem.dtype), interpret)
                    else:
                        vd_smem[...] = acc.astype(vd_smem.dtype)
                    copy_out(((vd_smem, out_ref.at[b, rows, hkv]),))
                return
            dk_smem = dk_smem2.at[wg]
            dk_smem[...] = dk.astype(dk_smem.dtype)
            vd_smem[...] = dv.astype(vd_smem.dtype)  # Ṽ is no longer needed: reuse its SMEM
            copy_out(((dk_smem, dk_ref.at[b, rows, hkv]), (vd_smem, dv_ref.at[b, rows, hkv])))

        def step(idx, *args):  # args: the eight tiles, the consumed barriers, the carry
            tiles, consumed, carry = args[:8], args[8:-1], args[-1]
            # a query tile that sees none of this warpgroup's keys adds nothing (see SKIP_EMPTY_STEPS)
            needed = (needed_query_tile(head_and_tile(idx[0])[1], cta_keys + wg * TILE, offset=offset)
                      if causal and SKIP_EMPTY_STEPS else None)
            return guarded_step(lambda c: backprop(idx, *tiles, c), carry, consumed, needed=needed,
                                skipped=_skipped_step)

        def backprop(idx, q_smem, qs_smem, qt_smem, lse_smem, delta_smem, do_smem, dot_smem, dosc_smem, carry):
            dk_acc, dv_acc = carry
            k_smem, vd_smem = k_smem2.at[wg], vd_smem2.at[wg]
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
                                     key_of_column=key_pairs.key_of_row if pairs else None)
            if causal and MASK_RAW_SCORES:
                st = mask(st)
            if per_block:  # one K scale per key tile, one Q scale per query tile: a scalar each
                q0, k0 = scalar(qs_smem), scalar(ks_smem2.at[wg])
                st = st * (k0 * q0)  # base-2 scores Sᵀ
            else:
                st = st * rows_of(row_vector(ks_smem2.at[wg]), shape) * cols_of(qs, shape)
            if causal and not MASK_RAW_SCORES:
                st = mask(st)
            pt = jnp.exp2(st - cols_of(col_vector(lse_smem), shape))
            # P̂ per key row of the tile for dV += P̂ᵀdÔ (dO one scale per query tile, stored repeated per row)
            p8, p_scale = int8.quantize_unit(pt, 1, truncating_convert=True, broadcast=lambda v: rows_of(v, shape))
            p_op = a_operand(p8, p_smem, p_in_registers)
            dv_scale = p_scale * scalar(dosc_smem)
            # dSᵀ = Pᵀ ∘ (dPᵀ − D), one scale per tile, for dK += dŜᵀQ̂
            dst = pt * (dpt - cols_of(col_vector(delta_smem), shape))
            if per_block:
                ds8, ds_scale = _ds_quantize(dst, red_smem2.at[wg], ds_per_row, interpret)
                factor = ds_scale * q0 * (1.0 / LOG2E)
            else:
                ds8, ds_scale = _ds_quantize(dst * cols_of(qs, shape), red_smem2.at[wg], ds_per_row, interpret)
                factor = ds_scale * (1.0 / LOG2E)
            ds_op = a_operand(ds8, ds_smem, ds_in_registers)
            if fused_dq:  # dŜ (queries × keys), keys contiguous: the A operand of dQ += dŜK̂ (per-tile scale)
                if pairs:
                    key_pairs.store_transposed(dsq_smem2.at[wg], ds8, interpret)
                else:
                    _store_transposed(dsq_smem2.at[wg], ds8)
            if fused_dq or smem_p or smem_ds:
                plgpu.commit_smem()  # P̂ or dŜ went to SMEM, or dŜ transposed
            # dV and dK (INT8): issued together at head dim 64 (causal, with the fused dQ, dQ's dŜK̂ too); at 128
            # one after the other, since two (64 × 128) int32 products beside the dK, dV accumulators spill registers
            products = ((p_op, dot_smem.T), (ds_op, qt_smem.T))
            out_shape = (TILE, head_dim)
            dq_factor = ds_scale * k0 * scale if fused_dq else None  # dS scale · K scale · softmax scale
            if fused_dq:
                acc = reduce_add_slot(dq_ref, (kv_block, wg), interpret=interpret)
                dq_dst = lambda cols: acc.at[b, pl.ds(t * TILE, TILE), h0 + g, cols]  # noqa: E731
                kt_smem = kt_smem2.at[wg]
            dq_joins = fused_dq and head_dim <= 64 and causal and DQ_WITH_DKDV_CAUSAL
            if dq_joins:  # the dQ stage freed while the three run (reduce_add.early_stage_wait)
                free = early_stage_wait()
                dv_part, dk_part, dq_part = matmuls((out_shape,) * 3, (jnp.int32,) * 3,
                                                    (*products, (dsq_smem2.at[wg], kt_smem.T)), fused=fused,
                                                    issued=free)
            elif head_dim <= 64:
                dv_part, dk_part = matmuls((out_shape,) * 2, (jnp.int32,) * 2, products, fused=fused)
            else:
                dv_part = matmul(out_shape, jnp.int32, *products[0])
            dv_acc = dv_acc + dv_part.astype(jnp.float32) * rows_of(dv_scale, out_shape)
            if head_dim > 64:
                dk_part = matmul(out_shape, jnp.int32, *products[1])
            dk_acc = dk_acc + dk_part.astype(jnp.float32) * (rows_of(factor, out_shape) if ds_per_row else factor)
            if dq_joins:  # dQ += dŜK̂ · dq_factor, INT8, reduce-added into the float32 dQ
                reduce_add_product(stage2.at[wg], dq_part, dq_dst(pl.ds(0, head_dim)), interpret=interpret,
                                   factor=dq_factor, waited=free is not None, permuted=permuted)
            elif fused_dq:
                # the stage freed early from EARLY_FREE_MIN_HEAD_DIM: at D64 this product follows dV's and dK's wait,
                # where Attn-QAT's kernel measured 2.5% slower with it (benchmarks/NOTES.md, forty-second session)
                reduce_add_matmul(stage2.at[wg], dsq_smem2.at[wg], lambda cols: kt_smem.at[cols].T, head_dim, dq_dst,
                                  interpret=interpret, acc_dtype=jnp.int32, factor=dq_factor,
                                  early=head_dim >= EARLY_FREE_MIN_HEAD_DIM, permuted=permuted)
            return dk_acc, dv_acc

        def a_operand(codes, scratch, registers):  # an INT8 A operand of dV or dK (committed after both)
            if operand:  # Q̂ᵀ, dÔᵀ in operand order: the registers as they are
                return operand_order.register_operand(codes, scratch, interpret, commit=False)
            return register_operand(codes, scratch, interpret, commit=False, registers=registers)

        pipeline = compute_pipeline(step, compute, steps=group * n_vis, compute_wgs=WGS, stages=items.stages,
                                    in_specs=in_specs(head_and_tile), state=state)
        pipeline(*gmem(b, hkv), allocations=allocations)

    # persistent (not causal): every item's pipeline runs over all query tiles of the group's heads
    items.run(item, in_specs(functools.partial(group_tile, n_tiles=n_qtiles)), gmem(0, 0), compute_wgs=WGS)


def _store_transposed(ref, codes: jax.Array) -> None:
    """``ref[...] = codes.T`` for an INT8 WGMMA-layout tile: through the WGMMA_TRANSPOSED register layout
    (one lane shuffle per register pair; Mosaic GPU stores 8-bit tiles transposed only from it)."""
    ref.T[...] = plgpu.layout_cast(codes.astype(jnp.int32), plgpu.Layout.WGMMA_TRANSPOSED).astype(jnp.int8)


# ----------------------------------------------------------------------------- dQ


def _dq_kernel(q_ref, qs_ref, lse_ref, delta_ref, do_ref, k_ref, ks_ref, kt_ref, vd_ref, dq_ref,
               q_smem2, do_smem2, qs_smem2, lse_smem2, delta_smem2, *scratch, group, scale, per_block, head_dim,
               fused, causal, offset, ds_per_row, interpret):
    """dQ. ``scratch``: [dŜ (:func:`_smem_operands`)], the row-maximum vectors, the barriers."""
    smem_ds = _smem_operands(head_dim, interpret)[1]
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
        if causal and MASK_RAW_SCORES:  # (see MASK_RAW_SCORES)
            s = mask(s)
        if per_block:  # one Q scale per query tile, one K scale per key tile: a scalar each
            k0 = scalar(ks_smem)
            s = s * (scalar(qs_smem2.at[wg]) * k0)
        else:
            s = s * rows_of(row_vector(qs_smem2.at[wg]), shape) * cols_of(ks, shape)
        if causal and not MASK_RAW_SCORES:
            s = mask(s)
        p = jnp.exp2(s - rows_of(row_vector(lse_smem2.at[wg]), shape))
        ds = p * (dp - rows_of(row_vector(delta_smem2.at[wg]), shape))
        if per_block:
            ds8, ds_scale = _ds_quantize(ds, red_smem2.at[wg], ds_per_row, interpret)
            factor = ds_scale * k0 * scale
        else:
            ds8, ds_scale = _ds_quantize(ds * cols_of(ks, shape), red_smem2.at[wg], ds_per_row, interpret)
            factor = ds_scale * scale
        ds_op = register_operand(ds8, ds_smem, interpret, registers=head_dim >= REGISTER_DS_MIN_HEAD_DIM)
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
                         dq_zeros: jax.Array | None = None, interpret: bool = False) -> tuple[jax.Array, ...]:
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
    (``sage_bwd.sage_bwd_kv_operands``); only with the fused dQ and pair order on. Otherwise they are natural
    and permuted here by XLA.

    ``dq_zeros``: with the fused dQ, a zeroed float32 (B, Sq_pad, Hq, D) array to accumulate dQ in
    (``sage_bwd.sage_bwd_preprocess(zero_dq=True)``); without it the accumulator is filled here.
    """
    b, hq, sq_pad, d = q8.shape
    hkv, sk_pad = k8.shape[1], k8.shape[2]
    f16, i8, f32 = do.dtype, jnp.int8, jnp.float32
    do = pad_rows(do, tma_rows(sq_len))  # read by tiled TMA loads
    fused_dq = k8_t is not None
    if fused_dq and not supports_fused_dq(head_dim=d, per_block=per_block, ds_per_row=ds_per_row):
        raise ValueError("the fused dQ needs per-block Q/K scales and per-tile dS scales")
    if fused_dq and scale is None:
        raise ValueError("the fused dQ needs scale (the softmax scale) beside k8_t")
    pairs = fused_dq and key_pairs.ENABLED
    if keys_in_pair_order and not pairs:
        raise ValueError("keys_in_pair_order: K̂ and Ṽ come in pair order only with the fused dQ and "
                         "key_pairs.ENABLED")
    if pairs and not keys_in_pair_order:  # the kernel's K̂ and Ṽ rows in pair order (Ṽ's permutation fuses into
        # its dequantization); the fused dQ has per-block K scales (supports_fused_dq), equal on every key of a
        # 16-key block: left as they are
        k8, vd = key_pairs.to_pair_order(k8, 2), key_pairs.to_pair_order(vd, 2)
    permuted = fused_dq and permutes_dq_stage(d, interpret)
    if operand_order_in and not takes_operand_order(d, interpret):
        raise ValueError("operand_order_in: the kernel takes Q̂ᵀ, dÔᵀ in operand order only where "
                         "takes_operand_order()")
    kv_blocks = sk_pad // (WGS * TILE)
    items = WorkItems.plan((hkv, kv_blocks, b), ("heads", "kv", "batch"), steps=(hq // hkv) * (sq_pad // TILE),
                           stages=STAGES_D64 if d <= 64 else STAGES, causal=causal, interpret=interpret)
    kernel = functools.partial(_dkdv_kernel, items=items, group=hq // hkv, n_qtiles=sq_pad // TILE,
                               per_block=per_block, head_dim=d, fused=not interpret, causal=causal,
                               offset=sk_len - sq_len, ds_per_row=ds_per_row, fused_dq=fused_dq, pairs=pairs,
                               operand=operand_order_in, scale=scale, permuted=permuted, interpret=interpret)
    operand_tiles = [wg_tiles(WGS, TILE, i8, TILE)] * sum(_smem_operands(d, interpret))  # P̂ᵀ, dŜᵀ if in SMEM
    scratch = [wg_tiles(WGS, TILE, i8, d), wg_tiles(WGS, TILE, f16, d), plgpu.SMEM((WGS, TILE), f32),
               *([] if fused_dq else [wg_tiles(WGS, TILE, f16, d)]), *operand_tiles, plgpu.SMEM((WGS, TILE), f32),
               plgpu.Barrier(num_barriers=(4 if fused_dq else 3, WGS))]
    args = [q8, q_scale, q8_t, lse_pad, delta, do, do8_t, do_scale, k8, k_scale, vd]
    if fused_dq:
        # K̂ᵀ, dŜ (queries × keys) and the float32 stage per warpgroup; the float32 dQ (one per key block
        # and warpgroup interpreted)
        chunks = d // REDUCE_COLS if DQ_STAGE_PER_CHUNK else 1
        scratch += [wg_tiles(WGS, d, i8, TILE), wg_tiles(WGS, TILE, i8, TILE), reduce_add_stage(WGS, TILE, chunks)]
        args += [k8_t, reduce_add_accumulator((b, sq_pad, hq, d), (kv_blocks, WGS), interpret=interpret,
                                              after=do, zeros=dq_zeros)]
    elif dq_zeros is not None:
        raise ValueError("dq_zeros: only the fused dQ (k8_t given) accumulates dQ")
    dk, dv = launch(kernel, [jax.ShapeDtypeStruct((b, tma_rows(sk_len), hkv, d), f16)] * 2, scratch,
                    items, None, name="sage_bwd_dkdv_dq" if fused_dq else "sage_bwd_dkdv", compute_wgs=WGS,
                    interpret=interpret,
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
    ds_tiles = [wg_tiles(WGS, TILE, i8, TILE)] if _smem_operands(d, interpret)[1] else []  # dŜ if in SMEM
    scratch = [wg_tiles(WGS, TILE, i8, d), wg_tiles(WGS, TILE, f16, d)] + [plgpu.SMEM((WGS, TILE), f32)] * 3 + [
        *ds_tiles, plgpu.SMEM((WGS, TILE), f32), plgpu.Barrier(num_barriers=(5, WGS))]
    dq = launch(kernel, jax.ShapeDtypeStruct((b, tma_rows(sq_len), hq, d), f16), scratch,
                (hq, sq_pad // (WGS * TILE), b), ("heads", "q", "batch"), name="sage_bwd_dq", compute_wgs=WGS,
                interpret=interpret,
                )(q8, q_scale, lse_pad, delta, do, k8, k_scale, k8_t, vd)
    return trim_rows(dq, sq_len)
