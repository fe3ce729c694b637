"""INT8 flash-attention forward (SageAttention) in Pallas Mosaic GPU (Hopper).

The numerics of :mod:`pallas_kernels.sage_fwd` (the Triton kernel) and of the
pure-JAX reference: S = Q̂K̂ᵀ·s_Q·s_K in base 2, online softmax, P̃ = exp2(S − rowmax
of the tile) quantized to INT8 per row (the row max maps to 127), O accumulates
int32(P̂V̂)·β/127 with β = exp2(m_tile − m_ref), m_ref the running row max (or, with
:data:`LAZY_RESCALE`, a reference max at most 8 below it: a factor 2^8), s_V applied per channel at the end,
l from the unquantized P̃, and the base-2 log-sum-exp (+inf for rows that see no key).

FlashAttention-3's shape: grid (query head, query block, batch); a memory
warpgroup streams K̂ (block_k, D), its scales and V̂ᵀ (D, block_k) through a
two-stage TMA pipeline; compute warpgroups each own 64 query rows: two per CTA at D128, three at D64
(:data:`THREE_WGS`, FlashAttention-3's 192-row tile there). Both
products are INT8 ``wgmma`` with K-major operands (B = a transposed view of K̂ or
V̂ᵀ); P̂ is the A operand straight from registers, no SMEM round trip and no warpgroup barrier:
V̂ᵀ's keys come in :mod:`pallas_kernels.operand_order` (written so by ``sage_quantize_kv``), so P̂'s registers are
the operand as they are (``operand_order.register_operand``; without it, ``register_operands.register_operand``
relays P̂ out by two lane shuffles per 4 values). That cut the hot loop from 1044 to 996 instructions per thread and
step and the forward kernel by 1.5% at B16 H10/5 S2048 D64 causal, 5.5% at B8 H32 S2048 D64, 2.8% at B4 H32 S4096 D128
on the H200 (benchmarks/NOTES.md, thirty-second session). Causal (bottom-right aligned,
Sq ≤ Sk): the pipeline stops after the last key tile the block's last row sees, the heaviest query blocks launch
first (:data:`HEAVY_FIRST`), and
tiles that reach the diagonal or the ragged key tail are masked element-wise, the others skip the mask.
Without ping-pong (three warpgroups), a warpgroup also skips the tiles past its own last row's diagonal and, in the
last CTA, every tile if its rows are all padding (:data:`SKIP_EMPTY_STEPS`).

Not covered (:func:`supports`; the Triton kernel runs instead): Q-smoothing bias,
head dims other than 64/128, key tiles other than 64/128, Sq_pad not a multiple of 128.
Two compute warpgroups take turns on the tensor cores (FlashAttention-3's ping-pong,
:data:`PINGPONG`); three run unscheduled. ``SageFwdConfig.fwd_backend="auto"`` (the default) takes it on Hopper at head
dims 64 and 128 (:data:`AUTO_MIN_HEAD_DIM`): on the H200 (forward with quantization) it is 3–10% faster than
the Triton kernel at D128 (B4 H32 S4096, causal too, and B1 S16384; fourteenth and fifteenth sessions), and
with per-block scales read as one scalar product per step, 0–2% faster fwd+bwd at D64 (benchmarks/NOTES.md,
twentieth session).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lowbit_jax.formats import int8, sage_tiles
from pallas_kernels import operand_order
from pallas_kernels._mosaic import (
    PingPong, WorkItems, col_vector, cols_of, compute_pipeline, copy_in, copy_out, grid_position, guarded_step,
    key_step_specs, launch, mask_scores, matmul, needed_step, pad_rows, pl, plgpu,
    query_block_keys, query_ctas, query_warpgroups, row_vector, rows_of, scalar, schedule_barrier,
    transposed_step_spec, trim_rows, wg_tiles, wgmma_zeros,
)
from pallas_kernels.configs import SageFwdConfig
from pallas_kernels.register_operands import int8_operand_in_smem, register_operand
from pallas_kernels.warp_reduce import warp_any_above

TILE = 64  # query rows per compute warpgroup
WGS = 2  # compute warpgroups per CTA where THREE_WGS does not apply
#: FlashAttention-3's 192-row tile at head dim 64: three compute warpgroups per CTA (no ping-pong), so each SM has
#: a third warpgroup's softmax work to issue (152 registers each, no spills). On the H200 the forward kernel is
#: 3.6% faster at B16 H10/5 S2048 D64 causal, 10.8% at B8 H32 S2048 D64, 9.8% at B2 H16 S8192 D64 causal
#: (benchmarks/NOTES.md, thirty-fourth session). The last CTA may pass Q's padded length: ``_mosaic.query_ctas``
#: gives each array's rows (compiled, Q is not padded: a pad copy cost 0.026 ms at the first shape).
THREE_WGS = True
THREE_WGS_MAX_HEAD_DIM = 64
STAGES = 2
#: FlashAttention-3's ping-pong between the two compute warpgroups (``_mosaic.PingPong``): one's softmax
#: runs while the other's products occupy the tensor cores (interpreted too: it orders execution only, and the
#: interpreter checks its barrier protocol).
#: With P̂ in registers it pays (H200, forward incl. quantization, ping-pong vs not: B4 H32 S4096 D128
#: 2.30 vs 2.40 ms, B8 H32 S2048 D64 1.005 vs 1.03, B16 H10/5 S2048 D64 causal 0.442 vs 0.451;
#: benchmarks/NOTES.md, fourteenth session)
PINGPONG = True
#: ``SageFwdConfig.fwd_backend="auto"`` takes this kernel on Hopper from this head dim up: with ping-pong it beats
#: the Triton forward at head dim 128 (H200, incl. quantization: B4 H32 S4096 2.30 vs 2.46 ms, causal 1.49 vs
#: 1.54, B1 S16384 7.74 vs 8.54, causal 4.43 vs 4.57; fifteenth session); at 64, level then, it is 0–2% faster
#: fwd+bwd since the per-block scales became one scalar product (B16 H10/5 S2048 causal, B8 H32 S2048, B2 H16
#: S8192 causal; benchmarks/NOTES.md, twentieth session)
AUTO_MIN_HEAD_DIM = 64
#: V̂ᵀ's keys in :mod:`pallas_kernels.operand_order`, so P̂ is PV's A operand as the registers hold it
OPERAND_ORDER = True
#: with per-block scales keep the scores unscaled through the row maximum and fold the scale into the exponent
#: (``exp2(s·c − m)``, one FFMA) instead of scaling every score first (an FMUL per score): this kernel 2.2–2.7% faster
#: at B8 H32 S2048 D64, B4 H32 S4096 D128 and its causal twin, level at B16 H10/5 S2048 D64 causal (H200, device
#: busy time; benchmarks/NOTES.md, thirty-third session). The dK/dV kernel's twin of it timed level and was dropped.
SCALE_IN_EXP = True
#: the smallest scale product used: a positive normal float, so a masked −inf score stays −inf when scaled
MIN_SCALE = float(jnp.finfo(jnp.float32).tiny)
#: without ping-pong (three compute warpgroups, at D64), a warpgroup skips the steps that are nothing to it: key
#: tiles past the last key its last row sees (causal: a CTA streams up to its *last* warpgroup's diagonal, 128 rows
#: past the first's) and every step if all its rows are padding (the last 192-row CTA passes Sq). The skipped step
#: would leave the row state and O exactly as they are (m unchanged, α = 1, P̂ = 0). Of the steps the three
#: warpgroups run, 10% are such at Sq = Sk = 2048 causal, 8% at 4096, 3% non-causal (``_mosaic.needed_step``). On the
#: H200 this kernel is 5.9% faster at B16 H10/5 S2048 D64 causal (0.2843 / 0.2860 → 0.2678 / 0.2686 ms), 5.1% at
#: B8 H32 S2048 D64 causal (0.4436 / 0.4442 → 0.4198 / 0.4227); same values (benchmarks/NOTES.md, thirty-seventh
#: session). The skipping warpgroup still arrives on the pipeline's barriers, and the others no longer share the
#: SM's issue slots with its empty work.
SKIP_EMPTY_STEPS = True
#: causal: grid index 0 along the query blocks takes the last block, which sees the most keys
#: (``_mosaic.query_block_keys(heavy_first_of=…)``, as the Attn-QAT forward), so the longest CTAs are not the last
#: ones launched (in launch order the grid went light → heavy within each batch, and the last batch's heaviest
#: CTAs trailed the grid). On the H200 this kernel is 2.1% faster at B16 H10/5 S2048 D64 causal (0.2688 / 0.2686 →
#: 0.2631 / 0.2629 ms), 1.4% at B8 H32 S2048 D64 causal (0.4227 / 0.4234 → 0.4172 / 0.4172), 3.1% at B4 H32 S4096
#: D128 causal (0.9617 / 0.9632 → 0.9342 / 0.9317); same values (benchmarks/NOTES.md, thirty-eighth session).
HEAVY_FIRST = True
#: FlashAttention-4's conditional rescaling: O's accumulator and l stay relative to a reference max that may
#: trail the running row max by up to :data:`LAZY_RESCALE_BITS` (base 2), and are rescaled (one multiply per O
#: element) only in the steps where some row of a warp gets a tile max further above it (``warp_reduce.warp_any_above``,
#: a ``vote.sync`` per warp; interpreted, per warpgroup). The values are those of the per-step rescaling up to
#: float32 rounding: P̂'s codes are relative to the tile's own max either way, and its scale β/127 with
#: β = exp2(m_tile − m_ref) ≤ 2^8 carries the same factor that O's rescaling would; the LSE is m_ref + log2 l.
#: On the H200 the kernel is 3.0% faster at B16 H10/5 S2048 D64 causal (0.2631 → 0.2550 ms) but 1.1% slower at
#: B8 H32 S2048 D64 and 2.5% slower at B4 H32 S4096 D128 causal (benchmarks/NOTES.md, forty-sixth session), so it
#: is taken only where it gained: causal (:data:`LAZY_RESCALE_CAUSAL_ONLY`) at head dims up to
#: :data:`LAZY_RESCALE_MAX_HEAD_DIM` (:func:`rescales_lazily`).
LAZY_RESCALE = True
LAZY_RESCALE_BITS = 8.0
LAZY_RESCALE_CAUSAL_ONLY = True
LAZY_RESCALE_MAX_HEAD_DIM = 64


def rescales_lazily(head_dim: int, causal: bool) -> bool:
    """Whether the forward rescales O and l only when a row max passes its reference by more than 8 (base 2;
    :data:`LAZY_RESCALE`)."""
    return (LAZY_RESCALE and head_dim <= LAZY_RESCALE_MAX_HEAD_DIM
            and (causal or not LAZY_RESCALE_CAUSAL_ONLY))


def compute_wgs(head_dim: int) -> int:
    """Compute warpgroups per CTA (64 query rows each) at this head dim (``_mosaic.query_warpgroups``)."""
    return query_warpgroups(head_dim, three=THREE_WGS, max_head_dim=THREE_WGS_MAX_HEAD_DIM, two=WGS)


def takes_operand_order(interpret: bool) -> bool:
    """Whether this kernel should be given V̂ᵀ in operand order (``OPERAND_ORDER`` and ``operand_order.available``)."""
    return OPERAND_ORDER and operand_order.available(interpret)


def supports(*, sq_len: int, sk_len: int, sq_pad: int, head_dim: int, causal: bool, has_bias: bool,
             config: SageFwdConfig) -> bool:
    """Whether the Mosaic forward covers this call (else the Triton kernel runs)."""
    return (not has_bias and head_dim in (64, 128) and config.block_k in (64, 128) and sq_pad % (2 * TILE) == 0
            and (not causal or sq_len <= sk_len))


def _skipped_step(carry):
    """A step ``_mosaic.needed_step`` rules out: the carry (O's accumulator, m, l) as it is."""
    return carry


def _fwd_kernel(q_ref, qs_ref, k_ref, ks_ref, vt_ref, vs_ref, o_ref, lse_ref, q_smem2, qs_smem2, vs_smem2,
                *scratch, items, group, block_k, head_dim, sq_len, sk_len, causal, offset, scalar_scales, operand, wgs,
                interpret):
    """``scratch``: [P̂ (only where it goes through SMEM: ``register_operands.int8_operand_in_smem``)], O, the LSE,
    the barriers, the ping-pong barrier. ``operand``: V̂ᵀ's keys are in :mod:`pallas_kernels.operand_order`."""
    p_smem2, o_smem2, lse_smem2, barriers, sched = (
        scratch if int8_operand_in_smem(interpret) else (None, *scratch))
    wg = lax.axis_index("wg")
    shape = (TILE, block_k)
    pp = PingPong(sched, wg, PINGPONG and wgs == 2)
    skips = SKIP_EMPTY_STEPS and not pp.enabled
    lazy = rescales_lazily(head_dim, causal)
    in_specs = [*key_step_specs(block_k, head_dim), transposed_step_spec(block_k, head_dim)]

    def item(pos, state, allocations):  # one (head, query block, batch) work item (_mosaic.WorkItems)
        b, h, _ = grid_position(pos)
        hkv = lax.div(h, group)
        cta_queries, n_steps, masked = query_block_keys(wgs * TILE, k_ref.shape[2], block_k, sk_len=sk_len,
                                                        causal=causal, offset=offset,
                                                        heavy_first_of=-(-q_ref.shape[2] // (wgs * TILE))
                                                        if HEAVY_FIRST else None, block=pos["q"])
        q_start = cta_queries + wg * TILE
        rows = pl.ds(q_start, TILE)

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
            lse_smem[...] = sage_tiles.base2_lse(m, l)
            copy_out(((o_smem, o_ref.at[b, rows, h]), (lse_smem, lse_ref.at[b, h, rows])))

        def step(idx, k_smem, ks_smem, vt_smem, *consumed_and_carry):
            *consumed, carry = consumed_and_carry
            # an empty step leaves the carry as it is (see SKIP_EMPTY_STEPS)
            needed = (needed_step(idx[0], q_start, block_k=block_k, sq_len=sq_len, causal=causal, offset=offset)
                      if skips else None)
            return guarded_step(lambda c: attend(idx, k_smem, ks_smem, vt_smem, c), carry, consumed, needed=needed,
                                skipped=_skipped_step)

        def attend(idx, k_smem, ks_smem, vt_smem, carry):
            acc, m_prev, l_prev = carry
            s = matmul(shape, jnp.int32, q_smem2.at[wg], k_smem.T, issued=pp.sync).astype(jnp.float32)
            c = None  # the scores' scale where it is folded into the exponent
            if scalar_scales and SCALE_IN_EXP:  # s stays in units of c > 0: max(s)·c is the row max of s·c
                c = jnp.maximum(scalar(qs_smem2.at[wg]) * scalar(ks_smem), MIN_SCALE)
            elif scalar_scales:  # one Q scale per 64-row tile, one K scale per key step: one multiply per score
                s = s * (scalar(qs_smem2.at[wg]) * scalar(ks_smem))
            else:
                s = s * rows_of(row_vector(qs_smem2.at[wg]), shape) * cols_of(col_vector(ks_smem), shape)
            if masked:
                s = mask_scores(s, idx[0] * block_k, q_start, causal=causal, offset=offset, sk_len=sk_len)
            m_cur = jnp.max(s, axis=1)
            if c is not None:
                m_cur = m_cur * c
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

        pipeline = compute_pipeline(step, compute, steps=n_steps, compute_wgs=wgs, stages=items.stages,
                                    in_specs=in_specs, state=state)
        pipeline(k_ref.at[b, hkv], ks_ref.at[b, hkv], vt_ref.at[b, hkv], allocations=allocations)

    items.run(item, in_specs, (k_ref.at[0, 0], ks_ref.at[0, 0], vt_ref.at[0, 0]), compute_wgs=wgs)


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
      vt8: int8 (B, Hkv, D, Sk_pad); v_scale float32 (B, Hkv, D).
      sq_len, sk_len, causal: real lengths and the bottom-right aligned causal mask.
      out_dtype: dtype of o (bf16/fp16/fp32).
      config: ``block_k`` is the P quantization tile (64 or 128).
      per_block: the Q and K scales are per block (``config.block_q``, ``config.block_k``): equal within each
        64-row tile and each key step, so the scores take one scalar product per step (two ``_mosaic.scalar``
        reads) instead of a row and a column broadcast (fwd+bwd 1.5–2.5% faster at D128 on the H200;
        benchmarks/NOTES.md, twentieth session).
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
    items = WorkItems.plan((hq, rows.ctas, b), ("heads", "q", "batch"), steps=k8.shape[2] // config.block_k,
                           stages=STAGES, causal=causal, interpret=interpret)
    kernel = functools.partial(_fwd_kernel, items=items, group=hq // hkv, block_k=config.block_k, head_dim=d,
                               sq_len=sq_len, sk_len=sk_len, causal=causal, offset=sk_len - sq_len,
                               interpret=interpret, scalar_scales=per_block and config.block_q % TILE == 0,
                               operand=v_operand_order, wgs=wgs)
    p_tile = [wg_tiles(wgs, TILE, jnp.int8, config.block_k)] if int8_operand_in_smem(interpret) else []
    scratch = [wg_tiles(wgs, TILE, jnp.int8, d), plgpu.SMEM((wgs, TILE), f32), plgpu.SMEM((wgs, d), f32),
               *p_tile, plgpu.SMEM((wgs, TILE, d), out_dtype),
               plgpu.SMEM((wgs, TILE), f32), plgpu.Barrier(num_barriers=(3, wgs)), schedule_barrier()]
    q8, q_scale = pad_rows(q8, rows.q, axis=2), pad_rows(q_scale, rows.q, axis=2)
    out_type = [jax.ShapeDtypeStruct((b, rows.o, hq, d), out_dtype),
                jax.ShapeDtypeStruct((b, hq, rows.row_outputs), f32)]
    o, lse = launch(kernel, out_type, scratch, items, None,
                    name="sage_attention_fwd", compute_wgs=wgs,
                    interpret=interpret)(q8, q_scale, k8, k_scale, vt8, v_scale)
    return trim_rows(o, sq_len), trim_rows(lse, sq_len, axis=2)
