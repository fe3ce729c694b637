"""Attn-QAT forward (NVFP4 fake-quantized P) in Pallas Mosaic GPU (Hopper).

The numerics of :mod:`pallas_kernels.qat_fwd` (the Triton kernel) and of
``lowbit_jax.qat_reference.qat_forward_reference``: S = Q̃K̃ᵀ·scale·log2 e (16-bit
``wgmma``, fp32 accumulation) on the fake-quantized operands, online softmax in
base 2, P = exp2(S − m) with m the running row max at the tile, P̃ = FQ(P) in
groups of 16 keys per row, O += P̃Ṽ and the high-precision O' += PṼ; l from the
unquantized P; outputs O, O', the base-2 log-sum-exp (+inf for rows that see no
key) and the row max m.

FlashAttention-3's shape, as :mod:`pallas_kernels.sage_fwd_mosaic`: grid (query
head, 128-query block, batch); a memory warpgroup streams K̃ and Ṽ tiles through a
two-stage TMA pipeline; two compute warpgroups each own 64 query rows (three in the O-only forward at D64,
non-causal: :data:`THREE_WGS`; a warpgroup then skips the key tiles that are nothing to it). P̃ and P are
the register A operands of the two PV products (16-bit, so the accumulator layout
converts directly), issued together into the rescaled O and O' accumulators; with
``QatConfig.pingpong`` (the default) the two warpgroups take turns on the tensor cores
(FlashAttention-3's ping-pong, :class:`pallas_kernels._mosaic.PingPong`). O leaves through Q's
SMEM tile (Q is not read after the pipeline), so 128-key tiles fit in SMEM with O'. FQ(P)
runs on the accumulator tile with K̃ and Ṽ in lane order (:mod:`pallas_kernels.lane_groups`: each
thread holds whole groups of 16 keys). Causal (bottom-right aligned, Sq ≤ Sk): the pipeline
stops after the last key tile the block sees, the heaviest blocks launch first; tiles that reach the diagonal or the
ragged key tail are masked element-wise, the others skip the mask.

Not covered (:func:`supports`; the Triton kernel runs instead): head dims other
than 64/128, key tiles other than 64/128, Sq_pad not a multiple of 128, fp32
outputs. Selected by ``QatConfig.fwd_backend`` "mosaic", or "auto" (the default) on Hopper: on the
H200 it beat the Triton forward at every benchmarked shape (375 vs 264 TFLOP/s at B4 H32
S4096 D128 with keys in lane order, 327 vs 282 before; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from lowbit_jax.formats import int8, sage_tiles
from pallas_kernels import lane_groups
from pallas_kernels._mosaic import (
    PingPong, WorkItems, accumulate, compute_pipeline, copy_in, copy_out, grid_position, guarded_step, launch,
    mask_scores, matmul, needed_step, pad_rows, pl, plgpu, query_block_keys, query_ctas, query_warpgroups,
    rows_of, schedule_barrier, tile_transforms, trim_rows, wg_tiles, wgmma_zeros,
)
from pallas_kernels.configs import QatConfig
from pallas_kernels.register_operands import register_operand

TILE = 64  # query rows per compute warpgroup
WGS = 2  # compute warpgroups per CTA where THREE_WGS does not apply
#: three compute warpgroups per CTA (192 query rows, no ping-pong) at head dim ≤ THREE_WGS_MAX_HEAD_DIM, for the calls
#: :func:`compute_wgs` names: the O-only forward (no O′: inference, or a call not differentiated), non-causal. On the
#: H200 with the 128-key steps and the empty-step skip (:data:`SKIP_EMPTY_STEPS`), the O-only forward kernel (two
#: repeats; benchmarks/NOTES.md, fifty-first session): non-causal B8 H32 S2048 D64 0.864 / 0.855 → 0.816 / 0.807 ms,
#: B16 H10/5 S2048 D64 0.550 / 0.544 → 0.523 / 0.515; causal B16 H10/5 S2048 D64 level, B8 H32 S2048 D64 +1.5%,
#: B2 H16 S8192 D64 +9.5%. The training forward (O and O′ accumulators) is 38–42% slower with three (B8 H32 S2048
#: D64 1.00 → 1.38 ms), so it keeps two. (With 64-key steps and no skip three were slower everywhere: thirty-fifth
#: session.)
THREE_WGS = True
THREE_WGS_MAX_HEAD_DIM = 64
#: whether causal O-only calls take three warpgroups too (see :data:`THREE_WGS`)
THREE_WGS_CAUSAL = False
#: probe, off: the training forward (with O′) takes three warpgroups too where :data:`THREE_WGS` applies (38–42%
#: slower on the H200, see there: with the O and O′ accumulators ptxas spills 400 bytes at 152 registers per compute
#: thread, none with two warpgroups; benchmarks/NOTES.md, fifty-first session)
THREE_WGS_WITH_AUX = False
STAGES = 2
#: keep the scores unscaled through the row maximum and fold the softmax scale into the exponent
#: (``exp2(s·c − m)``, one FFMA per score instead of an FMUL and an FADD), as ``sage_fwd_mosaic.SCALE_IN_EXP``: on
#: the H200 this kernel 0.468 → 0.456 ms at B16 H10/5 S2048 D64 causal, 1.278 → 1.266 at B8 H32 S2048 D64, 3.354 →
#: 3.311 at B4 H32 S4096 D128 (float32 FQ(P); benchmarks/NOTES.md, fortieth session)
SCALE_IN_EXP = True
#: without ping-pong (three compute warpgroups), a warpgroup skips the key tiles that are nothing to it
#: (``_mosaic.needed_step``: past its last row's diagonal, causal, or every tile if its rows are all padding)
#: and leaves its carry as it is, as ``sage_fwd_mosaic.SKIP_EMPTY_STEPS``
SKIP_EMPTY_STEPS = True
#: FQ(P)'s e2m1 rounding with explicit packed fma (``lane_groups.fake_quant_p(fma=True)``): the same values, the hot
#: loop 890 → 858 SASS instructions per thread and step at B8 H32 S2048 D64. On the H200 (two repeats,
#: benchmarks/NOTES.md, fifty-sixth session) this kernel 1.032 / 1.034 → 1.010 / 1.018 ms at B8 H32 S2048 D64, 0.376 /
#: 0.379 → 0.372 / 0.374 at B16 H10/5 S2048 D64 causal, 2.629 / 2.648 → 2.604 / 2.585 at B4 H32 S4096 D128, 5.25 / 5.20
#: → 5.12 / 5.22 at B1 H32 S16384 D128 causal (the backward's twin switch, ``qat_bwd_mosaic.EXPLICIT_FMA``, lost)
EXPLICIT_FMA = True
#: FQ(P)'s group scales by conversion to e4m3 and an approximate reciprocal (``lane_groups.fake_quant_p(fast_scale=
#: True)``): the same values (checked compiled on every bf16 amax, ``benchmarks/nvfp4_scale_check.py``); per group
#: one multiply, two conversions and a MUFU.RCP instead of ``_sixth``, the float32 magic-number rounding and a
#: correctly rounded division. Hot loop 858 → 806 SASS instructions per thread and step at B8 H32 S2048 D64; on the
#: H200 (two repeats, benchmarks/NOTES.md, fifty-seventh session) this kernel 0.983 / 0.985 → 0.952 / 0.962 ms there,
#: 1.369 / 1.354 → 1.357 / 1.341 at B4 H32 S4096 D128 causal, level at B4 H32 S4096 D128 and B16 H10/5 S2048 D64
#: causal (the backward's twin, ``qat_bwd_mosaic.FAST_SCALE``, lost)
FAST_SCALE = True
#: probe, not yet timed: FQ(P)'s bit operation (``(t & 0x7F80) | 0x40``, two LOP3 with an immediate each in the SASS)
#: as one ``lop3.b32`` per register (``lane_groups.fake_quant_p(lop3=True)``; the same values): 32 instructions per
#: thread and step fewer at B8 H32 S2048 D64 if ptxas keeps it one LOP3
PACKED_LOP3 = False
#: probe, not yet timed: FQ(P)'s group maxima from S's (``lane_groups.group_max`` of the masked score tile, whose
#: maximum is then the row maximum) as exp2(max·c − m), the exponential being increasing, instead of a reduction of
#: bf16(P) after every exponential: the group scales can then be computed while the exponentials run (off the path
#: from S to the P̃Ṽ product). The same values interpreted; compiled as long as ex2.approx is monotone
GROUP_MAX_FROM_S = False
LOG2E = math.log2(math.e)


def compute_wgs(head_dim: int, causal: bool, with_aux: bool) -> int:
    """Compute warpgroups per CTA (64 query rows each) of a call at this head dim (``_mosaic.query_warpgroups``):
    three where :data:`THREE_WGS` applies (the O-only forward, ``with_aux=False``; non-causal unless
    :data:`THREE_WGS_CAUSAL`), else two."""
    three = THREE_WGS and (THREE_WGS_WITH_AUX or not with_aux) and (THREE_WGS_CAUSAL or not causal)
    return query_warpgroups(head_dim, three=three, max_head_dim=THREE_WGS_MAX_HEAD_DIM, two=WGS)


def supports(*, sq_len: int, sk_len: int, sq_pad: int, head_dim: int, causal: bool, out_dtype,
             config: QatConfig) -> bool:
    """Whether the Mosaic forward covers this call (else the Triton kernel runs)."""
    return (head_dim in (64, 128) and config.block_k in (64, 128) and sq_pad % (2 * TILE) == 0
            and jnp.dtype(out_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and (not causal or sq_len <= sk_len))


def _skipped_step(carry):
    """A step ``_mosaic.needed_step`` rules out: the carry (O's and O′'s accumulators, m, l) as it is."""
    return carry


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, items, group, block_k, head_dim, sq_len, sk_len, causal, offset,
                score_scale, with_aux, pingpong, wgs, interpret):
    n_out = 4 if with_aux else 3
    outs, scratch = refs[:n_out], list(refs[n_out:])
    q_smem2 = o_smem2 = scratch.pop(0)  # Q is not read after the pipeline: O goes out through its SMEM
    o2_smem2 = scratch.pop(0) if with_aux else None
    lse_smem2, m_smem2, barriers, sched, *p_smem = scratch
    p_smem = p_smem[0] if interpret else None  # (WGS, 2, TILE, block_k): the interpreter's A operands
    o_ref, o2_ref, lse_ref, m_ref = outs if with_aux else (outs[0], None, *outs[1:])
    wg = lax.axis_index("wg")
    shape = (TILE, block_k)
    out_shape = (TILE, head_dim)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    pp = PingPong(sched, wg, pingpong and wgs == 2)
    skips = SKIP_EMPTY_STEPS and not pp.enabled

    def kv_spec(dtype):
        return plgpu.BlockSpec((block_k, head_dim), lambda j: (j, 0), transforms=tile_transforms(dtype, head_dim))

    in_specs = [kv_spec(k_ref.dtype), kv_spec(v_ref.dtype)]

    def item(pos, state, allocations):  # one (head, 128-query block, batch) work item (_mosaic.WorkItems)
        b, h, _ = grid_position(pos)
        hkv = lax.div(h, group)
        cta_queries, n_steps, masked = query_block_keys(wgs * TILE, k_ref.shape[2], block_k, sk_len=sk_len,
                                                        causal=causal, offset=offset,
                                                        heavy_first_of=-(-q_ref.shape[2] // (wgs * TILE)),
                                                        block=pos["q"])
        q_start = cta_queries + wg * TILE
        rows = pl.ds(q_start, TILE)

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
            # a key tile none of this warpgroup's rows sees leaves its carry as it is (see SKIP_EMPTY_STEPS)
            needed = (needed_step(idx[0], q_start, block_k=block_k, sq_len=sq_len, causal=causal, offset=offset)
                      if skips else None)
            return guarded_step(lambda c: attend(idx, k_smem, v_smem, c), carry, consumed, needed=needed,
                                skipped=_skipped_step)

        def attend(idx, k_smem, v_smem, carry):
            acc, acc2, m_prev, l_prev = carry
            s = matmul(shape, jnp.float32, q_smem2.at[wg], k_smem.T, issued=pp.sync)
            if not SCALE_IN_EXP:
                s = s * score_scale
            if masked:
                s = mask_scores(s, idx[0] * block_k, q_start, causal=causal, offset=offset, sk_len=sk_len,
                                key_of_column=lane_groups.key_order())
            if GROUP_MAX_FROM_S:  # each FP4 group's max of s, and the row max from them
                g, m_tile = lane_groups.group_max(s, interpret, row_max=True)
            else:
                g, m_tile = None, jnp.max(s, axis=1)
            if SCALE_IN_EXP:  # the scale is positive: max(s)·c is the row max of s·c (and −inf stays −inf)
                m_tile = m_tile * score_scale
            m_new = jnp.maximum(m_prev, m_tile)
            m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new

            def exp_of(x):  # exp2(x·c − m) (one FFMA), the same expression for the scores and their group maxima
                return jnp.exp2((x * score_scale if SCALE_IN_EXP else x) - rows_of(m_ref, shape))

            p = exp_of(s)
            rescale = jnp.exp2(m_prev - m_ref)  # of the running sums, per row
            alpha = rows_of(rescale, out_shape)
            l_new = l_prev * rescale + jnp.sum(p, axis=1)
            dt = v_smem.dtype
            pq = lane_groups.fake_quant_p(p, interpret, dtype=dt, fma=EXPLICIT_FMA, lop3=PACKED_LOP3,
                                          fast_scale=FAST_SCALE, amax=None if g is None else exp_of(g))
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

        pipeline = compute_pipeline(step, compute, steps=n_steps, compute_wgs=wgs, stages=items.stages,
                                    in_specs=in_specs, state=state)
        pipeline(k_ref.at[b, hkv], v_ref.at[b, hkv], allocations=allocations)

    items.run(item, in_specs, (k_ref.at[0, 0], v_ref.at[0, 0]), compute_wgs=wgs)


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
      lane_ordered: kf and vf are already in lane order (:mod:`pallas_kernels.lane_groups`, when
        ``lane_groups.ENABLED``: the operand pass writes them so); else they are reordered here.
    Returns:
      o (B, Sq, Hq, D), o_aux (same, or None), base-2 lse float32 (B, Hq, Sq) and the
      base-2 row max m float32 (B, Hq, Sq; −inf for rows that see no key).
    """
    b, hq, sq_pad, d = qf.shape
    hkv = kf.shape[1]
    f32 = jnp.float32
    wgs = compute_wgs(d, causal, with_aux)
    rows = query_ctas(sq_pad, sq_len, wgs * TILE, interpret)  # the last CTA may pass Sq_pad: see there
    items = WorkItems.plan((hq, rows.ctas, b), ("heads", "q", "batch"), steps=kf.shape[2] // config.block_k,
                           stages=STAGES, causal=causal, interpret=interpret)
    kernel = functools.partial(_fwd_kernel, items=items, group=hq // hkv, block_k=config.block_k, head_dim=d,
                               sq_len=sq_len, sk_len=sk_len, causal=causal, offset=sk_len - sq_len,
                               score_scale=scale * LOG2E, with_aux=with_aux, pingpong=config.pingpong, wgs=wgs,
                               interpret=interpret)
    if jnp.dtype(out_dtype) != qf.dtype:
        raise ValueError(f"out_dtype must be qf's dtype {qf.dtype} (O reuses Q's SMEM), got {jnp.dtype(out_dtype)}")
    o_tiles = wg_tiles(wgs, TILE, out_dtype, d)  # Q's, then O's; O' has its own (block_k 128 then fits in SMEM)
    scratch = [o_tiles, *([o_tiles] if with_aux else []),
               plgpu.SMEM((wgs, TILE), f32), plgpu.SMEM((wgs, TILE), f32), plgpu.Barrier(num_barriers=(1, wgs)),
               schedule_barrier()]
    if interpret:
        bk = config.block_k
        scratch.append(plgpu.SMEM((wgs, 2, TILE, bk), qf.dtype, transforms=tile_transforms(qf.dtype, bk)))
    if lane_groups.ENABLED and not lane_ordered:
        kf, vf = lane_groups.to_lane_order(kf, 2), lane_groups.to_lane_order(vf, 2)
    qf = pad_rows(qf, rows.q, axis=2)
    o_type = jax.ShapeDtypeStruct((b, rows.o, hq, d), out_dtype)
    row_type = jax.ShapeDtypeStruct((b, hq, rows.row_outputs), f32)
    *outs, lse, m = launch(kernel, [o_type] + ([o_type] if with_aux else []) + [row_type, row_type], scratch,
                           items, None, name="qat_attention_fwd",
                           compute_wgs=wgs, interpret=interpret)(qf, kf, vf)
    outs = [trim_rows(o, sq_len) for o in outs]
    return outs[0], outs[1] if with_aux else None, trim_rows(lse, sq_len, axis=2), trim_rows(m, sq_len, axis=2)
