"""ThriftAttention decode, the 4-bit runs: split-KV over the NVFP4 cache in Pallas Mosaic GPU (Hopper).

The numerics of the 4-bit splits of :mod:`pallas_kernels.thrift_decode` (the Triton kernel, which keeps the 16-bit
runs; :func:`pallas_kernels.thrift_combine.combine_decode` merges both). A CTA of one warpgroup owns one run of the
4-bit key blocks of one (batch, kv head) and one tile of N query rows (the group's heads × the new tokens, N = 8…64),
and writes its partial softmax (Oᵀ unnormalized, m, l).

The products are transposed, Sᵀ = K̃·Q̃ᵀ (64 keys × N) and Oᵀ += Ṽᵀ·P̃ᵀ (D × N), so that the decoded K̃ and Ṽᵀ
are the ``wgmma`` register A operands and the few query rows sit on N instead of being padded to M = 64:

* a code tile is loaded from SMEM in the accumulator's (WGMMA) layout, two bytes a lane: with
  :func:`pallas_kernels.numerics.nvfp4.pack_halves` (a byte holds elements i and i + n/2), a lane's first
  elements are its A-operand values of the first half and its second elements those of the second, so no value
  moves between lanes. Inline PTX places a byte pair's elements into an fp16 pair (``value · 2**-14``: one mask
  for the first, a shift each way for the second) and multiplies it by the pair's e4m3 group scale, converted
  once per group (:func:`_decode_asm`);
* K's scales (16 channels a group) are each row's own bytes, V's (16 keys a group) each channel's: every thread
  reads the scales of its own rows from the SMEM tile;
* FQ(P)'s group of 16 keys of a query is one warp's 16 rows of Sᵀ: its maximum takes a maximum over the thread's
  two rows and three lane shuffles (:func:`_key_group_max`); the block's row max across the four warps goes
  through SMEM (Mosaic GPU's reduction);
* the online softmax runs down the keys: l is accumulated per element and summed over the keys once, at the end;
* V is decoded while the tensor cores compute Sᵀ.

The cache layout (:class:`lowbit_jax.ThriftKVCache`) is the kernel's: K's codes (S, D/2) and scales (S, D/16)
token-major, V's codes block-major and channel-major within a block (a block's D rows of 32 bytes, one
contiguous 4 KB read at D128) and its scales (S/16, D). A one-warpgroup pipeline streams each
step's four tiles, the block index read from the run's order in SMEM. With ``ThriftConfig.decode_compute_wgs`` of 2
or 4 a CTA runs that many consecutive runs instead, one a compute warpgroup, and a producer warpgroup issues every
copy into the warpgroups' own SMEM slots (:func:`_kernel_producer`; the same numerics). Interpreted (the Mosaic GPU
interpreter has no inline PTX and takes SMEM operands only), the same values by ``jax.numpy`` and SMEM operand
tiles.

Covered (:func:`supports`): head dim 64 or 128, ``block`` 64, N = 8, 16, 32 or 64 query rows a CTA.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels._mosaic import (
    MEMORY_REGISTERS, accumulate, cols_of, compiler_params, interpret_params, launch, pl, plgpu, tile_transforms,
    wgmma_zeros,
)
from pallas_kernels._triton import E2M1_SPREAD, e2m1_lane_ptx
from pallas_kernels.configs import ThriftConfig
from pallas_kernels.stmatrix import Int, warp_and_lane
from pallas_kernels.numerics import nvfp4
from pallas_kernels.thrift_scalars import HEADER, N_LOW, check_scalars, padded_rows
from pallas_kernels.warp_reduce import column_reduce

LOG2E = math.log2(math.e)
BLOCK = 64  # keys a step: the wgmma M of Sᵀ
STAGES = 4  # TMA stages in flight (2 and 8 measured level with 4)
SCALE_ROW = 16  # bytes a row of the K scales' tile (TMA's smallest box row)


def supports(*, head_dim: int, block: int, row_tile: int) -> bool:
    """Whether the Mosaic kernel covers a decode call (else the Triton kernel runs its 4-bit runs too)."""
    return head_dim in (64, 128) and block == BLOCK and row_tile in (8, 16, 32, 64)


# ----------------------------------------------------------------------------- compiled-only pieces (inline PTX)


def _decode_asm(key: str) -> str:
    """PTX: a lane's two cache bytes ($1, low 16 bits) → the fp16 pair of their first (``key="lo"``) or second
    elements, times the scale pair $2 ($0): one byte permute, then :func:`pallas_kernels._triton.e2m1_lane_ptx`;
    the product is exact (see :func:`pallas_kernels.numerics.nvfp4.scale_tile_f16`)."""
    return "\n".join(["{", ".reg .b32 x, t, u;", f"prmt.b32 x, $1, 0, {E2M1_SPREAD[0]};",
                       *e2m1_lane_ptx("x", "x", key), "mul.rn.f16x2 $0, x, $2;", "}"])


#: PTX: the e4m3 byte ($1, low 8 bits) → the fp16 pair (scale, scale) ($0)
_SCALE_PAIR_ASM = "{ .reg .b32 x; .reg .b16 h; prmt.b32 x, $1, 0, 0x4400; cvt.u16.u32 h, x; " \
                  "cvt.rn.f16x2.e4m3x2 $0, h; }"


def _mlir():
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    return ir, arith, llvm, mgpu, mgpu_utils


def _scale_pair(smem, offset: Int):
    """In inline Mosaic GPU: the e4m3 scale at byte ``offset`` of the SMEM tile ``smem`` as an fp16 pair."""
    ir, arith, llvm, _, mgpu_utils = _mlir()
    i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
    byte = llvm.load(i8, mgpu_utils.getelementptr(mgpu_utils.memref_ptr(smem), [offset.value], i8))
    return llvm.inline_asm(i32, [arith.extui(i32, byte)], _SCALE_PAIR_ASM, "=r,r")


def _decoded(code_reg, pair, key):
    """In inline Mosaic GPU: a lane's code register (two bytes) → the scaled fp16 pair of its bytes' first
    (``key="lo"``) or second elements."""
    ir, arith, llvm, _, _ = _mlir()
    i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
    word = arith.extui(i32, llvm.bitcast(i16, code_reg))
    out = llvm.inline_asm(i32, [word, pair], _decode_asm(key), "=r,r,r")
    return llvm.bitcast(ir.VectorType.get((2,), ir.F16Type.get()), out)


def _decode_slab(regs, slab: int, smem, scale_at):
    """In inline Mosaic GPU: the registers of one 64-row slab of a decoded tile from the code registers ``regs``
    (a (rows, cols/2) uint8 WGMMA-layout array: (slab, 8-column chunk, 1, 1, row half, 1, 1, 1, 1)). The first
    elements of chunk j go to chunk j, the second ones to chunk j + cols/16 (element + cols/2, ``pack_halves``);
    their groups of 16 columns are j/2 and cols/32 + j/2. ``scale_at(row, group)``: the byte offset (an
    :class:`Int`) of a row's group scale in ``smem``; the scale of each (row, group) is loaded and converted once."""
    warp, lane = warp_and_lane()
    chunks = regs.shape[1]
    out = np.empty((1, 2 * chunks) + regs.shape[2:], dtype=object)
    for h in range(2):
        row = warp * 16 + (lane >> 2) + (64 * slab + 8 * h)  # rows r and r + 8 of the warp's 16, r = lane / 4
        pairs = {}
        for idx in np.ndindex(regs.shape):
            if idx[0] != slab or idx[4] != h:
                continue
            j = idx[1]
            for key, chunk, group in (("lo", j, j // 2), ("hi", j + chunks, chunks // 2 + j // 2)):
                if group not in pairs:
                    pairs[group] = _scale_pair(smem, scale_at(row, group))
                out[(0, chunk) + idx[2:]] = _decoded(regs[idx], pairs[group], key)
    return out


def _decode_k(codes: jax.Array, scales_ref) -> jax.Array:
    """K̃ (64, D) float16 WGMMA-layout from its codes (64, D/2) uint8 WGMMA-layout and the SMEM tile of its scales
    (row r's D/16 bytes at r·D/16)."""
    rows, half = codes.shape
    groups = 2 * half // nvfp4.GROUP
    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((rows, 2 * half), jnp.float16, layout=layout))
    def _k(ctx, arr, smem):
        del ctx
        out = _decode_slab(arr.registers, 0, smem, lambda r, g: r * groups + g)
        return _mlir()[3].FragmentedArray(_registers=out, _layout=arr.layout, _is_signed=None)

    return _k(plgpu.layout_cast(codes, layout), scales_ref)


def _decode_vt(codes: jax.Array, scales_ref) -> tuple[jax.Array, ...]:
    """Ṽᵀ as D/64 tiles (64 channels, 64 keys) float16 WGMMA-layout from its codes (D, 32) uint8 WGMMA-layout and
    the SMEM tile of its scales ((4, D): key group g of channel c at g·D + c)."""
    d, half = codes.shape
    layout = plgpu.Layout.WGMMA
    out_type = plgpu.ShapeDtypeStruct((64, 2 * half), jnp.float16, layout=layout)

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType()), return_type=(out_type,) * (d // 64))
    def _v(ctx, arr, smem):
        del ctx
        return tuple(_mlir()[3].FragmentedArray(
            _registers=_decode_slab(arr.registers, s, smem, lambda c, g: c + g * d), _layout=arr.layout,
            _is_signed=None) for s in range(d // 64))

    return _v(plgpu.layout_cast(codes, layout), scales_ref)


def _key_group_max(p: jax.Array) -> jax.Array:
    """For a (64, N) float32 WGMMA-layout tile of keys × queries: each element replaced by the maximum of its FP4
    group, the 16 keys of its warp (rows r and r + 8 of a thread, lanes 4·r + c over r): a maximum over the
    thread's two row halves, then three butterfly shuffles over the lane's row bits. NaN propagates."""
    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=plgpu.ShapeDtypeStruct(p.shape, p.dtype, layout=layout))
    def _max(ctx, arr):
        del ctx
        ir, arith, llvm, mgpu, _ = _mlir()
        from jax._src.lib.mlir.dialects import vector
        f32 = ir.F32Type.get()
        fmax = lambda a, b: llvm.inline_asm(f32, [a, b], "max.NaN.f32 $0, $1, $2;", "=f,f,f")  # noqa: E731

        def shuffle_max(x):
            for bit in (4, 8, 16):
                y = llvm.inline_asm(f32, [x], f"shfl.sync.bfly.b32 $0, $1, {bit}, 0x1f, 0xffffffff;", "=f,f")
                x = fmax(x, y)
            return x

        regs = arr.registers
        out = np.empty(regs.shape, dtype=object)
        for idx in np.ndindex(regs.shape):
            if idx[4]:
                continue
            other = idx[:4] + (1,) + idx[5:]
            pair = [fmax(*(vector.extract(regs[i], dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get(
                [e])) for i in (idx, other))) for e in range(2)]
            pair = [shuffle_max(x) for x in pair]
            vec = vector.from_elements(regs[idx].type, pair)
            out[idx] = out[other] = vec
        return mgpu.FragmentedArray(_registers=out, _layout=arr.layout, _is_signed=None)

    return _max(plgpu.layout_cast(p, layout))


# ----------------------------------------------------------------------------- interpreted twins (jax.numpy)


def _decode_k_interpreted(codes: jax.Array, scale_bits: jax.Array) -> jax.Array:
    """:func:`_decode_k`'s values from whole tiles: codes (64, D/2), the scales' (64·D/256, 16) tile."""
    values = nvfp4.e2m1_decode_f16(nvfp4.unpack_halves(codes))  # (64, D)
    return nvfp4.scale_tile_f16(values, scale_bits.reshape(codes.shape[0], -1), axis=1)


def _decode_vt_interpreted(codes: jax.Array, scale_bits: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`_decode_vt`'s values from whole tiles: codes (D, 32), scales (4, D)."""
    values = nvfp4.e2m1_decode_f16(nvfp4.unpack_halves(codes))  # (D, 64 keys)
    vt = nvfp4.scale_tile_f16(values, scale_bits.T, axis=1)
    return tuple(vt[s * 64:(s + 1) * 64] for s in range(codes.shape[0] // 64))


def _key_group_max_interpreted(p: jax.Array) -> jax.Array:
    """:func:`_key_group_max` by a reshape into groups of 16 keys."""
    g = p.reshape(p.shape[0] // nvfp4.GROUP, nvfp4.GROUP, p.shape[1])
    return jnp.broadcast_to(jnp.max(g, axis=1, keepdims=True), g.shape).reshape(p.shape)


# ----------------------------------------------------------------------------- the kernel


def _in_tiles(d: int) -> tuple[tuple[tuple[int, int], object], ...]:
    """(shape, transforms) of a block's four SMEM tiles: K's codes (64, D/2) and scales (64·D/256, 16 bytes), V's
    codes (D, 32) and scales (4, D)."""
    return (((BLOCK, d // 2), tile_transforms(jnp.uint8, d // 2)),
            ((BLOCK * d // nvfp4.GROUP // SCALE_ROW, SCALE_ROW), ()),
            ((d, BLOCK // 2), tile_transforms(jnp.uint8, BLOCK // 2)),
            ((BLOCK // nvfp4.GROUP, d), ()))


def _setup(qf_ref, scalars_ref, order_ref, q_smem, pos_smem, meta_smem, order_smem, barrier, *, n_rt: int,
           issue: bool = True):
    """The CTA's query rows, their positions, the scalars' header and the (b, kv head)'s block order, copied in
    (by this warpgroup if ``issue``) and waited for. Returns (b, kv head, the rows' slice, the 4-bit block
    count, block_of(j): the j-th block of the order)."""
    n, _ = q_smem.shape
    b, x = lax.axis_index("b"), lax.axis_index("x")
    hkv, rt = x // n_rt, x % n_rt
    rows = pl.ds(rt * n, n)
    header = pl.ds(padded_rows(scalars_ref), HEADER)
    copies = ((qf_ref.at[b, hkv, rows], q_smem), (scalars_ref.at[rows], pos_smem),
              (scalars_ref.at[header], meta_smem), (order_ref.at[b, hkv], order_smem))

    def copy_in():
        for i, (src, dst) in enumerate(copies):
            plgpu.copy_gmem_to_smem(src, dst, barrier.at[i])

    if issue is True:
        copy_in()
    else:  # one warpgroup copies, every warpgroup waits
        pl.when(issue)(copy_in)

    for i in range(len(copies)):
        plgpu.barrier_wait(barrier.at[i])
    width = order_smem.shape[1]

    def block_of(j):
        return order_smem[j // width, j % width].astype(jnp.int32)

    return b, hkv, rows, meta_smem[N_LOW], block_of


def _run(n_low, split, splits: int):
    """(first index into the order, block count) of 4-bit run ``split`` of ``splits``: contiguous runs of
    ⌈n_low / splits⌉ blocks (the Triton kernel's)."""
    per = (n_low + splits - 1) // splits
    i0 = split * per
    return i0, jnp.clip(n_low - i0, 0, per)


def _init_carry(n: int, d: int):
    """Oᵀ's D/64 (64, N) tiles, m (N,) and the per-element l (64, N) of an empty run."""
    m0 = plgpu.layout_cast(jnp.full((n,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(0))
    return tuple(wgmma_zeros((64, n)) for _ in range(d // 64)), m0, wgmma_zeros((BLOCK, n))


def _block_step(start, k_codes, k_scales, v_codes, v_scales, carry, *, q_smem, p_smem, positions, score_scale,
                interpret, k_op_smem=None, vt_op_smem=(), red_smem=None):
    """One 4-bit key block (its first key ``start``) into the online softmax ``carry`` (:func:`_init_carry`):
    Sᵀ = K̃·Q̃ᵀ, FQ(P̃) at the running max, Oᵀ += Ṽᵀ·P̃ᵀ. ``red_smem``: this warpgroup's (4, N) float32 scratch for
    the block's max over the keys (``warp_reduce.column_reduce``), where other compute warpgroups reduce at the
    same time; None: Mosaic GPU's own reduction."""
    n = q_smem.shape[0]
    accs, m_prev, l_acc = carry
    if interpret:
        k_op_smem[...] = _decode_k_interpreted(k_codes[...], k_scales[...])
        plgpu.commit_smem()
        k_op = k_op_smem
    else:
        k_op = _decode_k(plgpu.load(k_codes, layout=plgpu.Layout.WGMMA), k_scales)

    def scores_then_v(acc_ref):
        plgpu.wgmma(acc_ref, k_op, q_smem.T)
        if interpret:
            vts = _decode_vt_interpreted(v_codes[...], v_scales[...])
        else:  # decoded while the tensor cores compute Sᵀ
            vts = _decode_vt(plgpu.load(v_codes, layout=plgpu.Layout.WGMMA), v_scales)
        return acc_ref[...], vts

    s, vts = pl.run_scoped(scores_then_v, plgpu.ACC((BLOCK, n), jnp.float32))
    keys = plgpu.broadcasted_iota(jnp.int32, (BLOCK, n), 0, layout=plgpu.Layout.WGMMA) + start
    s = jnp.where(keys <= cols_of(positions, (BLOCK, n)), s * score_scale, -jnp.inf)
    # the max over the keys, across the four warps through SMEM
    m_block = jnp.max(s, axis=0) if red_smem is None else column_reduce(s, red_smem, "max", interpret)
    m_new = jnp.maximum(m_prev, m_block)
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s - cols_of(m_ref, (BLOCK, n)))
    alpha = cols_of(jnp.exp2(m_prev - m_ref), (BLOCK, n))
    l_acc = l_acc * alpha + p
    gmax = _key_group_max_interpreted(p) if interpret else _key_group_max(p)
    values, sf = nvfp4.fake_quant_parts(p, gmax, nonnegative=True, assume_finite=True)
    # V's 2**-14 back; stored query-major, (N, 64 keys): an 8-column tile has no swizzle, a 64-key row has
    p_smem.T[...] = (values * (sf * nvfp4.E2M1_F16_BIAS)).astype(jnp.float16)
    plgpu.commit_smem()  # P̃ᵀ is the product's B operand
    if interpret:
        a_ops = []
        for t, vt in zip(vt_op_smem, vts):
            t[...] = vt
            a_ops.append(t)
        plgpu.commit_smem()
    else:
        a_ops = vts
    accs = tuple(acc * alpha for acc in accs)  # Oᵀ's tiles have Sᵀ's shape (64, N)
    accs = accumulate(accs, tuple((a, p_smem.T) for a in a_ops), fused=not interpret)
    return accs, m_new, l_acc


def _write_partials(carry, acc_smem, ml_smem, acc_dst, m_dst, l_dst, *, red_smem=None,
                    interpret: bool = False) -> None:
    """A run's Oᵀ (D, N), m and l = Σ over the keys of the per-element l, through SMEM to their GMEM slices.
    ``red_smem`` as in :func:`_block_step`."""
    accs, m, l_acc = carry
    for s, acc in enumerate(accs):
        acc_smem[pl.ds(64 * s, 64), :] = acc
    ml_smem[0] = m
    ml_smem[1] = jnp.sum(l_acc, axis=0) if red_smem is None else column_reduce(l_acc, red_smem, "sum", interpret)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(acc_smem, acc_dst)
    plgpu.copy_smem_to_gmem(ml_smem.at[0], m_dst)
    plgpu.copy_smem_to_gmem(ml_smem.at[1], l_dst)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel(qf_ref, scalars_ref, order_ref, k4_ref, ks_ref, v4_ref, vs_ref, acc_out, m_out, l_out, *,
            q_smem, pos_smem, meta_smem, order_smem, p_smem, acc_smem, ml_smem, barrier, splits, n_rt, score_scale,
            interpret, k_op_smem=None, vt_op_smem=()):
    """One CTA of one warpgroup: (batch, kv head × row tile, run). Its query rows, their positions, the 4-bit block
    count and the (b, kv head)'s block order come in first; the pipeline then streams the run's blocks (K's codes
    and scales, V's codes and scales a step) and the epilogue writes Oᵀ, m and l of the run."""
    n, d = q_smem.shape
    split = lax.axis_index("split")
    b, hkv, rows, n_low, block_of = _setup(qf_ref, scalars_ref, order_ref, q_smem, pos_smem, meta_smem, order_smem,
                                           barrier, n_rt=n_rt)
    i0, count = _run(n_low, split, splits)
    positions = plgpu.load(pos_smem, layout=plgpu.Layout.WGMMA.reduce(0))  # one entry a query row
    in_specs = [plgpu.BlockSpec(shape, lambda i: (block_of(i0 + i), 0), transforms=transforms)
                for shape, transforms in _in_tiles(d)]
    step_kw = dict(q_smem=q_smem, p_smem=p_smem, score_scale=score_scale, interpret=interpret, k_op_smem=k_op_smem,
                   vt_op_smem=vt_op_smem)

    def step(idx, *tiles_and_carry):
        *tiles, carry = tiles_and_carry
        return _block_step(block_of(i0 + idx[0]) * BLOCK, *tiles, carry, positions=positions, **step_kw)

    pipeline = plgpu.emit_pipeline(step, grid=(count,), in_specs=in_specs, max_concurrent_steps=STAGES,
                                   init_carry=_init_carry(n, d))
    carry = pipeline(k4_ref.at[b, hkv], ks_ref.at[b, hkv], v4_ref.at[b, hkv], vs_ref.at[b, hkv])
    _write_partials(carry, acc_smem, ml_smem, acc_out.at[b, hkv, split, :, rows], m_out.at[b, hkv, split, rows],
                    l_out.at[b, hkv, split, rows])


def _kernel_producer(qf_ref, scalars_ref, order_ref, k4_ref, ks_ref, v4_ref, vs_ref, acc_out, m_out, l_out, *,
                     q_smem, pos_smem, meta_smem, order_smem, p_smem, acc_smem, ml_smem, barrier, tiles, loaded,
                     consumed, red_smem, splits, n_rt, score_scale, interpret, wgs, stages, compute_registers,
                     k_op_smem=None, vt_op_smem=()):
    """One CTA of ``wgs`` compute warpgroups and a producer warpgroup: (batch, kv head × row tile, ``wgs``
    consecutive runs). Compute warpgroup w runs the CTA's run w with the same numerics as :func:`_kernel`, from
    ``stages`` SMEM slots of its own (``tiles``: four (wgs, stages, …) arrays) that the producer fills by TMA,
    taking the warpgroups' next blocks in turn; ``loaded`` and ``consumed`` (wgs · stages barriers each) hand each
    slot over. The producer issues every copy, so the compute warps only wait on a slot's barrier and then arrive on
    its release. The reductions over the keys go through each warpgroup's own ``red_smem``."""
    n, d = q_smem.shape
    wg = lax.axis_index("wg")
    producer = wg == wgs
    b, hkv, rows, n_low, block_of = _setup(qf_ref, scalars_ref, order_ref, q_smem, pos_smem, meta_smem, order_smem,
                                           barrier, n_rt=n_rt, issue=producer)
    first = lax.axis_index("split") * wgs
    srcs = (k4_ref.at[b, hkv], ks_ref.at[b, hkv], v4_ref.at[b, hkv], vs_ref.at[b, hkv])

    def produce():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
        runs = [_run(n_low, first + w, splits) for w in range(wgs)]

        @pl.loop(0, functools.reduce(jnp.maximum, [count for _, count in runs]))
        def _(k):
            slot = lax.rem(k, stages)
            for w, (i0, count) in enumerate(runs):
                @pl.when(k < count)
                def _():
                    @pl.when(k >= stages)
                    def _():  # the slot's block of `stages` steps ago is consumed
                        plgpu.barrier_wait(consumed.at[w * stages + slot])

                    block = block_of(i0 + k)
                    for src, tile in zip(srcs, tiles):  # a block's tile: rows block · (its rows) …
                        rows_a_block = tile.shape[2]
                        plgpu.copy_gmem_to_smem(src.at[pl.ds(block * rows_a_block, rows_a_block)], tile.at[w, slot],
                                                loaded.at[w * stages + slot])

    def compute():
        plgpu.set_max_registers(compute_registers, action="increase")
        split = first + wg
        i0, count = _run(n_low, split, splits)
        positions = plgpu.load(pos_smem, layout=plgpu.Layout.WGMMA.reduce(0))
        step_kw = dict(q_smem=q_smem, p_smem=p_smem.at[wg], positions=positions, score_scale=score_scale,
                       interpret=interpret, k_op_smem=None if k_op_smem is None else k_op_smem.at[wg],
                       vt_op_smem=tuple(t.at[wg] for t in vt_op_smem), red_smem=red_smem.at[wg])

        def body(k, carry):
            slot = lax.rem(k, stages)
            plgpu.barrier_wait(loaded.at[wg * stages + slot])
            carry = _block_step(block_of(i0 + k) * BLOCK, *(t.at[wg, slot] for t in tiles), carry, **step_kw)
            plgpu.barrier_arrive(consumed.at[wg * stages + slot])
            return carry

        carry = lax.fori_loop(0, count, body, _init_carry(n, d))
        _write_partials(carry, acc_smem.at[wg], ml_smem.at[wg], acc_out.at[b, hkv, split, :, rows],
                        m_out.at[b, hkv, split, rows], l_out.at[b, hkv, split, rows], red_smem=red_smem.at[wg],
                        interpret=interpret)

    lax.cond(producer, produce, compute)


@functools.partial(jax.jit, static_argnames=("scale", "config", "row_tile", "rows", "interpret"))
def thrift_decode_low(qf_rows: jax.Array, scalars: jax.Array, order: jax.Array, k4: jax.Array,
                      k4_scale_bits: jax.Array, v4: jax.Array, v4_scale_bits: jax.Array, *, scale: float,
                      config: ThriftConfig, row_tile: int, rows: int | None = None,
                      interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Partial softmaxes of the decode rows over each run of the cache's 4-bit key blocks (the first
    ``config.decode_splits`` splits of :func:`pallas_kernels.thrift_decode.thrift_decode`, transposed).

    Args:
      qf_rows: (B, Hkv, R_pad, D) float16 φ⁻¹(φ(q_rows)) (:func:`lowbit_jax.thrift_reference.decode_rows`).
      scalars: int32 (R_pad + 8,) the decode's scalars (:mod:`pallas_kernels.thrift_scalars`): each row's token
        position (−1 for padding rows), and in the header :data:`~pallas_kernels.thrift_scalars.N_LOW`, the 4-bit
        blocks per (batch, kv head): the first entries of ``order``.
      order: int16 (B, Hkv, Nkb_pad) (:func:`lowbit_jax.thrift_reference.block_order`).
      k4: uint8 (B, Hkv, S_max, D/2); k4_scale_bits: uint8 (B, Hkv, S_max, D/16);
        v4: uint8 (B, Hkv, S_max/64 · D, 32); v4_scale_bits: uint8 (B, Hkv, S_max/16, D) (the
        :class:`lowbit_jax.ThriftKVCache` layout).
      scale: softmax scale; config: ``decode_splits`` set (:meth:`ThriftConfig.for_decode`), ``block`` 64;
      row_tile: query rows a CTA (8, 16, 32 or 64, dividing R_pad); rows: the real rows, the first of R_pad
        (None: all): the tiles past them are not run, and their rows of the outputs are left unwritten.
    Returns:
      accᵀ (B, Hkv, splits, D, R_pad) float32 (unnormalized, transposed), m and l (B, Hkv, splits, R_pad)
      float32 (base 2), splits = ``config.decode_splits``.
    """
    b, hkv, r_pad, d = qf_rows.shape
    check_scalars(scalars, r_pad)
    if not supports(head_dim=d, block=config.block, row_tile=row_tile):
        raise NotImplementedError(f"thrift_decode_low: head dim {d}, block {config.block}, {row_tile} rows a CTA")
    splits, _ = config.split_counts()
    n, n_rt = row_tile, -(-(r_pad if rows is None else rows) // row_tile)
    s_max = k4.shape[2]
    if order.shape[-1] < 8:  # a TMA copy moves 16 bytes or more
        order = jnp.pad(order, ((0, 0), (0, 0), (0, 8 - order.shape[-1])))
    nkb = order.shape[-1]
    width = max(8, nkb // 256)  # a TMA box has at most 256 entries a dimension
    order = order.reshape(b, hkv, nkb // width, width)
    f16, f32 = jnp.float16, jnp.float32
    ks = k4_scale_bits.reshape(b, hkv, s_max * d // nvfp4.GROUP // SCALE_ROW, SCALE_ROW)  # 16-byte rows for TMA
    wgs = producer_wgs(config, splits)
    per_wg = () if wgs == 1 else (wgs,)  # the producer kernel: one of each compute warpgroup's own tiles apiece
    scratch = dict(q_smem=plgpu.SMEM((n, d), f16, transforms=tile_transforms(f16, d)),
                   pos_smem=plgpu.SMEM((n,), jnp.int32), meta_smem=plgpu.SMEM((HEADER,), jnp.int32),
                   order_smem=plgpu.SMEM((nkb // width, width), order.dtype),
                   p_smem=plgpu.SMEM((*per_wg, n, BLOCK), f16, transforms=tile_transforms(f16, BLOCK)),
                   acc_smem=plgpu.SMEM((*per_wg, d, n), f32),
                   ml_smem=plgpu.SMEM((*per_wg, 2, n), f32),
                   barrier=plgpu.Barrier(num_barriers=4))
    if interpret:  # the interpreter's SMEM A operands: K̃ and Ṽᵀ's 64-channel tiles
        scratch["k_op_smem"] = plgpu.SMEM((*per_wg, BLOCK, d), f16, transforms=tile_transforms(f16, d))
        scratch["vt_op_smem"] = tuple(plgpu.SMEM((*per_wg, 64, BLOCK), f16, transforms=tile_transforms(f16, BLOCK))
                                      for _ in range(d // 64))
    common = dict(splits=splits, n_rt=n_rt, score_scale=scale * LOG2E * nvfp4.E2M1_F16_BIAS, interpret=interpret)
    out_type = (jax.ShapeDtypeStruct((b, hkv, splits, d, r_pad), f32), jax.ShapeDtypeStruct((b, hkv, splits, r_pad), f32),
                jax.ShapeDtypeStruct((b, hkv, splits, r_pad), f32))
    args = (qf_rows, scalars, order, k4, ks, v4, v4_scale_bits)
    if wgs == 1:
        return plgpu.kernel(functools.partial(_kernel, **common), out_type=out_type, scratch_types=scratch,
                            grid=(b, hkv * n_rt, splits), grid_names=("b", "x", "split"),
                            compiler_params=compiler_params(), interpret=interpret_params(interpret),
                            kernel_name="thrift_decode_low")(*args)
    scratch.update(tiles=tuple(plgpu.SMEM((wgs, STAGES, *shape), jnp.uint8, transforms=transforms)
                               for shape, transforms in _in_tiles(d)),
                   loaded=plgpu.Barrier(num_arrivals=4, num_barriers=wgs * STAGES),  # the four copies of a block
                   consumed=plgpu.Barrier(num_barriers=wgs * STAGES),
                   red_smem=plgpu.SMEM((wgs, 4, n), f32))  # each warpgroup's own (warp_reduce.column_reduce)
    kernel = functools.partial(_kernel_producer, wgs=wgs, stages=STAGES, compute_registers=compute_registers(wgs),
                               **common)
    return launch(kernel, out_type, scratch, (b, hkv * n_rt, splits // wgs), ("b", "x", "split"),
                  name="thrift_decode_low", compute_wgs=wgs, interpret=interpret)(*args)


def producer_wgs(config: ThriftConfig, splits: int) -> int:
    """Compute warpgroups a CTA of :func:`thrift_decode_low` (``ThriftConfig.decode_compute_wgs``): 1, the
    one-warpgroup kernel, where ``splits`` (the 4-bit runs) is not a multiple of the field."""
    wgs = config.decode_compute_wgs
    return wgs if splits % wgs == 0 else 1


def compute_registers(wgs: int) -> int:
    """Registers a thread of a compute warpgroup of the producer kernel: the SM's 64K shared by as many CTAs as keep
    16 compute warps an SM (the one-warpgroup kernel's four CTAs), less the producer's, rounded down to a multiple
    of 8 (``setmaxnreg``)."""
    ctas = max(1, 4 // wgs)
    return min(256, (65536 // ctas - 128 * MEMORY_REGISTERS) // (128 * wgs) // 8 * 8)
