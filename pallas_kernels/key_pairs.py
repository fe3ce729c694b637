"""Key pairs held by one thread: the key order of the fused SageBwd Mosaic kernel's K̂ and Ṽ tiles.

The fused SageBwd kernel (``sage_bwd_mosaic``, dQ reduce-added in the dK/dV kernel) holds dSᵀ as a
(keys × queries) WGMMA tile, but dQ = dŜK̂ needs dŜ (queries × keys, keys contiguous) in SMEM as its INT8
A operand: a transposed copy every step. In the WGMMA layout a thread holds rows ``g`` and ``g + 8`` of
its warp's 16 rows, so with keys in their natural order the two bytes that end up side by side in a
transposed row (keys 2i, 2i+1) live in different lanes: Mosaic GPU relays the tile out through int32 and
``WGMMA_TRANSPOSED`` (lane shuffles, selects and 2-byte stores: about 130 instructions per thread per
64×64 step, a tenth of the step; benchmarks/NOTES.md, thirty-first session).

Here the kernel's K̂ and Ṽ rows are stored in *pair order*: within every 16 keys, position ``8h + g``
holds key ``2g + h``. A thread's rows ``g`` and ``g + 8`` are then keys ``2g`` and ``2g + 1``: packed as
one 16-bit unit per query, they are one element of ``stmatrix.trans`` (8×8 16-bit matrices stored
transposed), which writes each query's 16 keys of the warp as one contiguous 16-byte row — natural key
order, so K̂ᵀ (dQ's B operand) and the stored dŜ are untouched (:func:`store_transposed`). dK and dV leave
the kernel in natural order too: :func:`store_rows` gives ``stmatrix`` each row's natural address. Only the
rows of Sᵀ, dPᵀ, dV and dK are permuted inside the kernel, and every reduction over them (the dS tile
maximum, the P̂ row scales) is order-free, so the values are the natural order's; masks map a row to its
key with :func:`key_of_row`.

``ENABLED`` (a module switch read at trace time, for ``benchmarks/variants.py``): off, the kernel takes
keys in natural order and stores the transposed copy through Mosaic GPU's relayout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._mosaic import plgpu, tile_transforms

#: keys per pair-order block (one warp's 16 rows of a WGMMA tile)
BLOCK = 16
#: store K̂ and Ṽ in pair order in the fused SageBwd kernel (transposed dŜ and dK/dV by ``stmatrix``)
ENABLED = True


def _reorder(x: jax.Array, axis: int, split: tuple[int, int]) -> jax.Array:
    axis %= x.ndim
    n = x.shape[axis]
    if n % BLOCK:
        raise ValueError(f"pair order needs a multiple of {BLOCK} keys on axis {axis}, got {n}")
    shape = x.shape[:axis] + (n // BLOCK, *split) + x.shape[axis + 1:]
    perm = list(range(len(shape)))
    perm[axis + 1], perm[axis + 2] = perm[axis + 2], perm[axis + 1]
    return jnp.transpose(x.reshape(shape), perm).reshape(x.shape)


def to_pair_order(x: jax.Array, axis: int) -> jax.Array:
    """Keys along ``axis`` (a multiple of 16) reordered so that position ``8h + g`` of each 16-block holds key
    ``2g + h`` of that block (XLA: one transpose)."""
    return _reorder(x, axis, (8, 2))


def from_pair_order(x: jax.Array, axis: int) -> jax.Array:
    """The inverse of :func:`to_pair_order`."""
    return _reorder(x, axis, (2, 8))


def key_of_row(row: jax.Array) -> jax.Array:
    """The key offset (from the tile's first key) stored at row ``row`` of a pair-ordered tile (int32)."""
    return (row & ~(BLOCK - 1)) | ((row & 7) << 1) | ((row >> 3) & 1)


def _ldst_shape():
    from jax._src.lib.mlir import ir

    return ir.Attribute.parse("#nvvm.ld_st_matrix_shape<m=8, n=8>")


def _lane_indices():
    """(warp in the warpgroup, lane // 8, lane % 8) of this thread, as i32 MLIR values."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    i32 = ir.IntegerType.get_signless(32)
    const = lambda v: arith.constant(i32, v)  # noqa: E731
    tid = arith.remui(mgpu_utils.thread_idx(), const(128))
    lane = arith.remui(tid, const(32))
    return arith.divui(tid, const(32)), arith.divui(lane, const(8)), arith.remui(lane, const(8))


def _tiled_strides(ref) -> tuple[int, int, int]:
    """Byte strides (row tile, column tile, row) of a 2-D SMEM ref tiled as (8, cols): its memref is
    (row tiles, column tiles, 8, cols) with unit stride last."""
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    ty = ir.MemRefType(ref.type)
    strides, _ = ty.get_strides_and_offset()
    if len(ty.shape) != 4 or ty.shape[2] != 8 or strides[3] != 1:
        raise NotImplementedError(f"expected a (row tiles, column tiles, 8, cols) SMEM tile, got {ty}")
    size = mgpu_utils.bitwidth(ty.element_type) // 8
    return strides[0] * size, strides[1] * size, strides[2] * size


def _check_registers(shape: tuple, cols: int) -> None:
    """The WGMMA register array of a (64, cols) tile as these stores index it (jax 0.11.2): index 1 the 8-column
    block, index 4 the row half (rows g, g + 8 of each warp's 16), every other index of size 1."""
    if shape != (1, cols // 8, 1, 1, 2, 1, 1, 1, 1):
        raise NotImplementedError(f"unexpected WGMMA register array {shape} for a (64, {cols}) tile")


def _swizzled(offset, chunk, swizzle: int):
    """The byte address of the 16-byte ``chunk`` of the row at byte ``offset`` in a ``swizzle``-byte swizzled SMEM
    tile: ``offset + (chunk ⊕ (offset // 128 mod swizzle // 16))·16``, as Mosaic GPU lays it out
    (``fragmented_array.transfer_tiled``)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith

    i32 = ir.IntegerType.get_signless(32)
    const = lambda v: arith.constant(i32, v)  # noqa: E731
    bits = arith.remui(arith.divui(offset, const(128)), const(swizzle // 16))
    return arith.addi(offset, arith.muli(arith.xori(chunk, bits), const(16)))


def store_transposed(ref, codes: jax.Array, interpret: bool) -> None:
    """``ref[q, k] = codes[row of key k, q]``: a (64 pair-ordered keys × n queries) INT8 WGMMA-layout tile into a
    (n queries × 64 keys) SMEM tile in natural key order (tiled (8, 64), 64-byte swizzle; n a multiple of 32).

    Compiled: two bytes per thread and query (keys 2g, 2g + 1: rows g and g + 8) packed into one 16-bit unit, four
    8×8 matrices of them per ``stmatrix.sync.aligned.m8n8.x4.trans.shared.b16`` (each lane gives the address of
    one query's 16-byte row of its warp's keys). Interpreted (no inline Mosaic GPU): the same bytes by a
    transpose."""
    keys, n = codes.shape
    if keys != 64 or n % 32 or ref.shape != (n, keys):
        raise ValueError(f"store_transposed takes a (64, n) tile (n a multiple of 32) into (n, 64), got {codes.shape} "
                         f"into {ref.shape}")
    if interpret:
        ref[...] = from_pair_order(codes, 0).T
        return
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, nvvm, vector
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType(tile_transforms(jnp.int8, keys))))
    def _store(ctx, arr, smem):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        const = lambda v: arith.constant(i32, v)  # noqa: E731
        tile_bytes, _, row_bytes = _tiled_strides(smem)
        warp, m, i = _lane_indices()
        # lane 8m + i: row i (query 8j + i, j the matrix's 8-query block) of matrix m, keys 16·warp … + 15
        row = arith.addi(arith.muli(m, const(tile_bytes)), arith.muli(i, const(row_bytes)))
        lane_offset = _swizzled(row, warp, 64)
        base = mgpu_utils.memref_ptr(smem)
        regs = arr.registers  # index 1: the 8-query block j; index 4: the row half h (rows g, g + 8)
        _check_registers(regs.shape, n)
        words: dict[int, ir.Value] = {}
        for idx in np.ndindex(regs.shape):
            if idx[4]:
                continue
            low, high = regs[idx], regs[idx[:4] + (1,) + idx[5:]]
            # bytes [key 2g at query 2c, key 2g + 1 at 2c, key 2g at 2c + 1, key 2g + 1 at 2c + 1]
            words[idx[1]] = mgpu_utils.bitcast(vector.shuffle(low, high, [0, 2, 1, 3]), i32)
        for first in range(0, n // 8, 4):
            ptr = mgpu_utils.getelementptr(base, [arith.addi(lane_offset, const(first // 4 * 4 * tile_bytes))],
                                           ir.IntegerType.get_signless(8))
            nvvm.stmatrix(ptr, [words[first + k] for k in range(4)], nvvm.MMALayout.col, _ldst_shape(),
                          nvvm.LdStMatrixEltType.B16)

    _store(plgpu.layout_cast(codes, layout), ref)


def store_rows(ref, x: jax.Array, interpret: bool) -> None:
    """``ref[key of row r] = x[r]``: a (64 pair-ordered keys × D) 16-bit WGMMA-layout tile (dK, dV) into a (64, D)
    SMEM tile in natural key order (tiled (8, 64), 128-byte swizzle; D a multiple of 64).

    Compiled: ``stmatrix.sync.aligned.m8n8.x4.shared.b16``, each lane giving its matrix row's natural address
    (the permutation costs nothing). Interpreted: the same rows by a transpose."""
    rows, d = x.shape
    if rows != 64 or d % 64 or ref.shape != x.shape or jnp.dtype(x.dtype).itemsize != 2:
        raise ValueError(f"store_rows takes a (64, D) 16-bit tile (D a multiple of 64) into its own shape, got "
                         f"{x.shape} {x.dtype} into {ref.shape}")
    if interpret:
        ref[...] = from_pair_order(x, 0)
        return
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, nvvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType(tile_transforms(x.dtype, d))))
    def _store(ctx, arr, smem):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        const = lambda v: arith.constant(i32, v)  # noqa: E731
        tile_bytes, col_tile_bytes, row_bytes = _tiled_strides(smem)
        warp, m, i = _lane_indices()
        # lane 8m + i: row i of matrix m = (row half h = m mod 2, 8-column block j + m // 2), i.e. the natural
        # key 16·warp + 2i + h
        key = arith.addi(arith.addi(arith.muli(warp, const(16)), arith.muli(i, const(2))), arith.remui(m, const(2)))
        key_in_tile = arith.remui(key, const(8))
        row = arith.addi(arith.muli(arith.divui(key, const(8)), const(tile_bytes)),
                         arith.muli(key_in_tile, const(row_bytes)))
        pair = arith.divui(m, const(2))  # which of the instruction's two 8-column blocks
        base = mgpu_utils.memref_ptr(smem)
        regs = arr.registers  # index 1: the 8-column block; index 4: the row half
        _check_registers(regs.shape, d)
        cols_per_tile = 64 // 8  # 8-column blocks (16 bytes) per 128-byte column tile
        for j in range(0, d // 8, 2):
            chunk = arith.addi(pair, const(j % cols_per_tile))
            offset = arith.addi(row, const(j // cols_per_tile * col_tile_bytes))
            ptr = mgpu_utils.getelementptr(base, [_swizzled(offset, chunk, 128)],
                                           ir.IntegerType.get_signless(8))
            sources = []
            for jj in (j, j + 1):
                for h in (0, 1):
                    sources.append(mgpu_utils.bitcast(regs[(0, jj, 0, 0, h, 0, 0, 0, 0)], i32))
            nvvm.stmatrix(ptr, sources, nvvm.MMALayout.row, _ldst_shape(), nvvm.LdStMatrixEltType.B16)

    _store(plgpu.layout_cast(x, layout), ref)
