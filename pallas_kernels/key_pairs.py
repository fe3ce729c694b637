"""Key pairs held by one thread: the key order of the fused SageBwd Mosaic kernel's K̂ and Ṽ tiles.

The fused SageBwd kernel (``sage_bwd_mosaic``, dQ reduce-added in the dK/dV kernel) holds dSᵀ as a
(keys × queries) WGMMA tile, but dQ = dŜK̂ needs dŜ (queries × keys, keys contiguous) in SMEM as its INT8
A operand: a transposed copy every step. In the WGMMA layout a thread holds rows ``g`` and ``g + 8`` of
its warp's 16 rows, so with keys in their natural order the two bytes that end up side by side in a
transposed row (keys 2i, 2i+1) live in different lanes: Mosaic GPU relays the tile out through int32 and
``WGMMA_TRANSPOSED`` (lane shuffles, selects and 2-byte stores: about 130 instructions per thread per
64×64 step, a tenth of the step).

Here the kernel's K̂ and Ṽ rows are stored in *pair order*: within every 16 keys, position ``8h + g``
holds key ``2g + h``. A thread's rows ``g`` and ``g + 8`` are then keys ``2g`` and ``2g + 1``: packed as
one 16-bit unit per query, they are one element of ``stmatrix.trans`` (8×8 16-bit matrices stored
transposed), which writes each query's 16 keys of the warp as one contiguous 16-byte row — natural key
order, so K̂ᵀ (dQ's B operand) and the stored dŜ are untouched (:func:`store_transposed`). dK and dV leave
the kernel in natural order too: :func:`store_rows` gives ``stmatrix`` each row's natural address. Only the
rows of Sᵀ, dPᵀ, dV and dK are permuted inside the kernel, and every reduction over them (the dS tile
maximum, the P̂ row scales) is order-free, so the values are the natural order's; masks map a row to its
key with :func:`key_of_row`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import stmatrix
from pallas_kernels._mosaic import plgpu, swap_within_blocks, tile_transforms

#: keys per pair-order block (one warp's 16 rows of a WGMMA tile)
BLOCK = 16


def _reorder(x: jax.Array, axis: int, split: tuple[int, int]) -> jax.Array:
    return swap_within_blocks(x, axis, split, "pair order")


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
    from jax._src.lib.mlir.dialects import vector
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType(tile_transforms(jnp.int8, keys))))
    def _store(ctx, arr, smem):
        del ctx
        const, (tile_bytes, _, row_bytes), warp, m, i, base = stmatrix.lane_context(smem)
        # lane 8m + i: row i (query 8j + i, j the matrix's 8-query block) of matrix m, keys 16·warp … + 15
        lane_offset = stmatrix.swizzled(m * tile_bytes + i * row_bytes, warp, 64)
        regs = arr.registers  # index 1: the 8-query block j; index 4: the row half h (rows g, g + 8)
        stmatrix.check_registers(regs.shape, n)
        # bytes [key 2g at query 2c, key 2g + 1 at 2c, key 2g at 2c + 1, key 2g + 1 at 2c + 1]
        words = [mgpu_utils.bitcast(vector.shuffle(regs[(0, j, 0, 0, 0, 0, 0, 0, 0)], regs[(0, j, 0, 0, 1, 0, 0, 0, 0)],
                                                   [0, 2, 1, 3]), const(0).type) for j in range(n // 8)]
        for first in range(0, n // 8, 4):
            stmatrix.stmatrix_x4(base, lane_offset + first * tile_bytes, words[first:first + 4], transposed=True)

    _store(plgpu.layout_cast(codes, layout), ref)


def store_rows(ref, x: jax.Array, interpret: bool) -> None:
    """``ref[key of row r] = x[r]``: a (64 pair-ordered keys × D) 16-bit WGMMA-layout tile (dK, dV) into a (64, D)
    SMEM tile in natural key order (:func:`pallas_kernels.stmatrix.store_rows`: no cost compiled)."""
    stmatrix.store_rows(ref, x, interpret, key_of_row=key_of_row, from_order=from_pair_order)
