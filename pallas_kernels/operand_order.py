"""Operand order: the contraction order in which an INT8 WGMMA accumulator-layout tile is, register for register,
the 8-bit register A operand of the next ``wgmma``.

The SageAttention kernels compute a tile (P̂ in the forward, P̂ᵀ and dŜᵀ in the backward) in the accumulator's
WGMMA layout and feed it to the next INT8 product as its A operand straight from registers. The two layouts differ
within every 16 columns: lane ``4r + c`` of a warp holds columns ``2c, 2c+1`` and ``8+2c, 9+2c`` of the
accumulator, but columns ``4c … 4c+3`` of the 8-bit A operand. With the contraction index in its natural order
that costs two lane shuffles and a byte permute per four values (``register_operands._wgmma_to_8bit``).

Here the product's *B operand* is stored with its contraction index in operand order instead: position
``4c + 2h + l`` of each 16-block holds index ``8h + 2c + l``. The A operand's column ``4c + 2h + l`` is then
exactly the accumulator column the lane already holds, so the relayout is a repack of its own registers
(:func:`register_operand`). The product's value is unchanged: the same index is contracted, in another order,
and INT8 products sum exactly. Only the B operand's layout changes — V̂ᵀ's keys for the forward's P̂V̂, Q̂ᵀ's and
dÔᵀ's queries for the backward's dŜᵀQ̂ and P̂ᵀdÔ — and the Triton kernels that write those transposed copies
permute their rows on the way (:func:`to_operand_order` inside the kernel, no extra pass); the accumulator tiles,
their masks and their reductions keep their natural order.

This removes about 5% of the hot loop's instructions in the forward and the fused backward (docs/performance.md);
permuting the INT8 copies by an XLA transpose instead would cost more than the kernels gain.
"""

from __future__ import annotations

import jax
import numpy as np

from pallas_kernels import register_operands
from pallas_kernels._mosaic import plgpu, swap_within_blocks

#: entries per operand-order block (one 16-column group of the 8-bit A operand)
BLOCK = 16


def available(interpret: bool) -> bool:
    """Whether kernels take operand order: interpreted (the permutation in jax.numpy), or compiled with this jax's
    WGMMA_8BIT layout as :func:`register_operand` assumes it (``register_operands.relayout_8bit``)."""
    return interpret or register_operands.relayout_8bit()


def check_block(block: int, name: str) -> None:
    """Operand order permutes within blocks of 16: a tile of ``block`` rows (argument ``name``) must hold whole ones."""
    if block % BLOCK:
        raise ValueError(f"operand order needs {name} a multiple of {BLOCK}, got {block}")


def to_operand_order(x: jax.Array, axis: int) -> jax.Array:
    """Entries along ``axis`` (a multiple of 16) reordered so that position ``4c + 2h + l`` of each 16-block holds
    entry ``8h + 2c + l`` of that block (XLA: one transpose)."""
    return swap_within_blocks(x, axis, (2, 4, 2), "operand order")


def transposed(x: jax.Array, permute: bool) -> jax.Array:
    """A (rows, cols) tile transposed, its rows first put in operand order if ``permute``: how the kernels that
    write a B operand's transposed copy (Q̂ᵀ, V̂ᵀ, dÔᵀ) write it, in-kernel (the rows a multiple of 16)."""
    return (to_operand_order(x, 0) if permute else x).T


def from_operand_order(x: jax.Array, axis: int) -> jax.Array:
    """The inverse of :func:`to_operand_order`."""
    return swap_within_blocks(x, axis, (4, 2, 2), "operand order")


def register_operand(x: jax.Array, scratch, interpret: bool, *, commit: bool = True):
    """An INT8 (64, n) WGMMA-layout tile (n a multiple of 16, columns in natural order) as the A operand of a
    ``wgmma`` whose B operand holds the contraction index in operand order.

    Compiled: the same registers regrouped into WGMMA_8BIT (each 32-bit register takes the lane's two column
    pairs of a 16-column group), no shuffle. Interpreted (SMEM operands only): the columns permuted by
    :func:`to_operand_order` into ``scratch``, followed by ``commit_smem`` unless ``commit=False``."""
    rows, n = x.shape
    if rows != 64 or n % BLOCK or np.dtype(x.dtype).itemsize != 1:
        raise ValueError(f"register_operand takes a (64, n) 8-bit tile, n a multiple of {BLOCK}; got {x.shape} "
                         f"{x.dtype}")
    if interpret:  # the SMEM operand, its columns permuted
        return register_operands.register_operand(to_operand_order(x, 1), scratch, interpret, commit=commit)

    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=plgpu.Layout.WGMMA_8BIT))
    def _repack(ctx, arr):
        del ctx
        return register_operands._wgmma_to_8bit(arr, shuffle=False)

    return _repack(plgpu.layout_cast(x, layout))
