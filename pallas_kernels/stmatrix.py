"""Stores of WGMMA-layout register tiles into swizzled SMEM by ``stmatrix``, with an address per lane.

Mosaic GPU stores a 16-bit WGMMA tile with ``stmatrix`` itself, but always row for row. The instruction takes one
row address from each lane, so a tile whose rows hold keys in a permuted order (the Mosaic kernels' key orders,
:mod:`pallas_kernels.lane_groups`, :mod:`pallas_kernels.key_pairs`) can be written back in natural order at no
cost (:func:`store_rows`), and with ``.trans`` 16-bit units of a tile can be written transposed
(``key_pairs.store_transposed``). Here: the inline Mosaic GPU pieces those stores share — this thread's lane
indices, the byte strides of a tiled SMEM ref, Mosaic GPU's swizzle — and :func:`store_rows`. Interpreted (the
Mosaic GPU interpreter has no inline Mosaic GPU) the stores are plain permutations in jax.numpy.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels._mosaic import plgpu, tile_transforms


def check_registers(shape: tuple, cols: int) -> None:
    """The WGMMA register array of a (64, cols) tile as these stores index it (jax 0.11.2): index 1 the 8-column
    block, index 4 the row half (rows g, g + 8 of each warp's 16), every other index of size 1."""
    if shape != (1, cols // 8, 1, 1, 2, 1, 1, 1, 1):
        raise NotImplementedError(f"unexpected WGMMA register array {shape} for a (64, {cols}) tile")


class Int:
    """An i32 MLIR value with the integer operators a key order's map uses (``&``, ``|``, ``^``, ``<<``, ``>>``,
    ``+``, ``*``, with Python ints or other ``Int`` s), so one function serves jax or numpy arrays and inline Mosaic
    GPU alike."""

    def __init__(self, value):
        self.value = value


def _int_operator(name: str):
    def apply(self: Int, other) -> Int:
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith

        rhs = other.value if isinstance(other, Int) else arith.constant(ir.IntegerType.get_signless(32), other)
        return Int(getattr(arith, name)(self.value, rhs))
    return apply


for _method, _op in (("__and__", "andi"), ("__or__", "ori"), ("__xor__", "xori"), ("__rxor__", "xori"),
                     ("__lshift__", "shli"), ("__rshift__", "shrui"), ("__add__", "addi"), ("__radd__", "addi"),
                     ("__mul__", "muli"), ("__rmul__", "muli")):
    setattr(Int, _method, _int_operator(_op))


def warp_and_lane() -> tuple[Int, Int]:
    """In inline Mosaic GPU: this thread's warp in its warpgroup (0..3) and its lane (0..31), as :class:`Int` s."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    tid = Int(arith.remui(mgpu_utils.thread_idx(), arith.constant(ir.IntegerType.get_signless(32), 128)))
    return tid >> 5, tid & 31


def lane_context(smem):
    """For an inline Mosaic GPU store into the tiled SMEM memref ``smem``: ``(const, (row tile, column tile, row)
    byte strides, warp in the warpgroup, lane // 8, lane % 8, base pointer)``, the indices as :class:`Int`."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    i32 = ir.IntegerType.get_signless(32)
    ty = ir.MemRefType(smem.type)
    strides, _ = ty.get_strides_and_offset()
    if len(ty.shape) != 4 or ty.shape[2] != 8 or strides[3] != 1:
        raise NotImplementedError(f"expected a (row tiles, column tiles, 8, cols) SMEM tile, got {ty}")
    size = mgpu_utils.bitwidth(ty.element_type) // 8
    warp, lane = warp_and_lane()
    return (lambda v: arith.constant(i32, v), tuple(s * size for s in strides[:3]), warp, lane >> 3, lane & 7,
            mgpu_utils.memref_ptr(smem))


def swizzled(offset: Int, chunk: Int, swizzle: int) -> Int:
    """The byte address of the 16-byte ``chunk`` of the row at byte ``offset`` in a ``swizzle``-byte swizzled SMEM
    tile: ``offset + (chunk ⊕ (offset // 128 mod swizzle // 16))·16``, as Mosaic GPU lays it out
    (``fragmented_array.transfer_tiled``). :class:`Int` s in inline Mosaic GPU; numpy integers (arrays) in the
    tests' models of a store's addresses."""
    bits = (offset >> 7) & (swizzle // 16 - 1)
    return offset + ((chunk ^ bits) << 4)


def stmatrix_x4(base, offset: Int, words: list, *, transposed: bool) -> None:
    """One ``stmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``: four 8×8 16-bit matrices, ``words`` this thread's
    i32 fragment of each, ``offset`` the byte offset (from ``base``) of the row this lane addresses."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import nvvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    ptr = mgpu_utils.getelementptr(base, [offset.value], ir.IntegerType.get_signless(8))
    nvvm.stmatrix(ptr, words, nvvm.MMALayout.col if transposed else nvvm.MMALayout.row,
                  ir.Attribute.parse("#nvvm.ld_st_matrix_shape<m=8, n=8>"), nvvm.LdStMatrixEltType.B16)


def store_rows(ref, x: jax.Array, interpret: bool, *, key_of_row: Callable, from_order: Callable) -> None:
    """``ref[key_of_row(r)] = x[r]``: a (64 × D) 16-bit WGMMA-layout tile whose rows hold keys in a permuted order
    into a (64, D) SMEM tile in natural key order (tiled (8, 64), 128-byte swizzle; D a multiple of 64).

    ``key_of_row`` maps a row index to its key (written with ``&``, ``|``, ``<<``, ``>>`` only, so it also runs on
    :class:`Int`); ``from_order(x, axis)`` is the same permutation undone in jax.numpy (the interpreted store).
    Compiled: ``stmatrix.sync.aligned.m8n8.x4.shared.b16``, each lane giving the natural address of the row it
    stores, so the permutation costs nothing."""
    rows, d = x.shape
    if rows != 64 or d % 64 or ref.shape != x.shape or jnp.dtype(x.dtype).itemsize != 2:
        raise ValueError(f"store_rows takes a (64, D) 16-bit tile (D a multiple of 64) into its own shape, got "
                         f"{x.shape} {x.dtype} into {ref.shape}")
    if interpret:
        ref[...] = from_order(x, 0)
        return
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType(tile_transforms(x.dtype, d))))
    def _store(ctx, arr, smem):
        del ctx
        const, (tile_bytes, col_tile_bytes, row_bytes), warp, m, i, base = lane_context(smem)
        # lane 8m + i: row i of matrix m = (row half h = m mod 2, 8-column block j + m // 2), i.e. tile row
        # 16·warp + 8h + i, holding key key_of_row(that row)
        key = key_of_row(warp * 16 + (m & 1) * 8 + i)
        row = (key >> 3) * tile_bytes + (key & 7) * row_bytes
        regs = arr.registers  # index 1: the 8-column block; index 4: the row half
        check_registers(regs.shape, d)
        blocks_per_tile = 128 // 16  # 16-byte column blocks per 128-byte column tile
        for j in range(0, d // 8, 2):
            offset = swizzled(row + j // blocks_per_tile * col_tile_bytes, (m >> 1) + j % blocks_per_tile, 128)
            words = [mgpu_utils.bitcast(regs[(0, jj, 0, 0, h, 0, 0, 0, 0)], const(0).type)
                     for jj in (j, j + 1) for h in (0, 1)]
            stmatrix_x4(base, offset, words, transposed=False)

    _store(plgpu.layout_cast(x, layout), ref)
