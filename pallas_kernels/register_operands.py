"""``wgmma`` A operands from registers in the Mosaic GPU kernels, INT8 ones included.

Mosaic GPU (jax 0.11.2) takes an INT8 ``wgmma`` A operand from registers only in its WGMMA_8BIT layout and has no
relayout into it from the accumulator's WGMMA layout that every computed tile (P̂, dŜ) has; importing this module
adds that one relayout at the first compiled kernel that needs it (:func:`relayout_8bit`; two lane shuffles and a
byte permute per four values, :func:`_wgmma_to_8bit`). :func:`register_operand` then turns a tile into an A operand:
from registers where it can,
through an SMEM tile where it cannot (the interpreter, which takes SMEM operands only, or a switch). Where the
product's B operand holds its contraction index permuted, ``operand_order.register_operand`` needs no shuffle.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._mosaic import plgpu


def _wgmma_to_8bit(x, *, shuffle: bool = True):
    """The relayout WGMMA → WGMMA_8BIT of an 8-bit ``mosaic.gpu`` FragmentedArray (shape (64·r, 16·c)).

    In the accumulator's WGMMA layout lane ``4·row + c`` holds columns 2c, 2c+1 of every 8-column
    group; the 8-bit ``wgmma`` A operand wants columns 4c…4c+3 of every 16-column group. Each lane
    packs its two pairs of a 16-column group into one 32-bit word; two ``shfl.idx`` from lanes
    4·row + 2(c mod 2) and that + 1 fetch the four bytes it needs, one ``prmt`` keeps the low
    (c < 2) or high (c ≥ 2) halves: 2 shuffles and 1 permute per 4 values, no SMEM, no barrier.
    ``shuffle=False``: the packed words as they are (the operand whose contraction index is in
    ``pallas_kernels.operand_order``).
    """
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, nvvm

    regs = x.registers
    new_shape = fa.WGMMA_LAYOUT_8BIT.registers_shape(x.shape)
    new = np.empty(new_shape, dtype=object)

    def packed(idx):  # the lane's two column pairs of 16-column group idx[1], as 4 bytes
        return mgpu_utils.vector_concat([regs[(idx[0], 2 * idx[1] + i, *idx[2:])] for i in range(2)])

    if not shuffle:
        for idx in np.ndindex(*new_shape):
            new[idx] = packed(idx)
        return fa.FragmentedArray(_registers=new, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=x.is_signed)

    i32 = ir.IntegerType.get_signless(32)
    const = lambda v: arith.constant(i32, v)  # noqa: E731
    lane = arith.remui(mgpu_utils.thread_idx(), const(32))
    quad = arith.remui(lane, const(4))
    src0 = arith.addi(arith.subi(lane, quad), arith.muli(arith.remui(quad, const(2)), const(2)))
    src1 = arith.addi(src0, const(1))
    low_half = arith.cmpi(arith.CmpIPredicate.ult, quad, const(2))
    perm = arith.select(low_half, const(0x5410), const(0x7632))

    def shfl(word, src):
        return nvvm.shfl_sync(mgpu_utils.c(0xFFFFFFFF, i32), word, src, const(0x1F), nvvm.ShflKind.idx)

    vec4 = ir.VectorType.get((4,), ir.VectorType(regs.flat[0].type).element_type)
    for idx in np.ndindex(*new_shape):
        word = mgpu_utils.bitcast(packed(idx), i32)
        blend = mgpu_utils.prmt(shfl(word, src0), shfl(word, src1), perm)
        new[idx] = mgpu_utils.bitcast(blend, vec4)
    return fa.FragmentedArray(_registers=new, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=x.is_signed)


def _expected_8bit_layouts(fa) -> tuple:
    """(WGMMA, WGMMA_8BIT) as :func:`_wgmma_to_8bit` assumes them (jax 0.11.2): lane 4·r + c holds columns
    2c, 2c+1 of each 8-column group, resp. 4c…4c+3 of each 16-column group, of rows r and r + 8 of its warp's 16."""
    return (fa.TiledLayout(fa.Tiling(((64, 8), (16, 8), (8, 8), (2,))), warp_dims=(-7,), lane_dims=(-3, -2),
                           vector_dim=-1),
            fa.TiledLayout(fa.Tiling(((64, 16), (16, 16), (8, 16), (4,))), warp_dims=(-7,), lane_dims=(-3, -2),
                           vector_dim=-1))


def _install_8bit_relayout() -> bool:
    """Let ``plgpu.layout_cast(x, Layout.WGMMA_8BIT)`` take an 8-bit tile out of the WGMMA layout.

    Mosaic GPU (jax 0.11.2) accepts an INT8 ``wgmma`` A operand in registers only in
    WGMMA_8BIT and implements no relayout into it from the layout every computed tile has
    (``to_layout`` raises NotImplementedError, and the warpgroup lowering's layout inference
    accepts only relayouts on its own list), which forced P̂ and dŜ through SMEM and a warpgroup
    barrier. This adds that one conversion (:func:`_wgmma_to_8bit`) in front of Mosaic's own
    ``FragmentedArray.to_layout`` and to that list; every other conversion is Mosaic's.

    Returns whether the relayout is available. Nothing is patched (False; :func:`register_operand`
    then uses SMEM) when this jax lacks the internals it extends or lays the two layouts out
    otherwise than :func:`_expected_8bit_layouts`. Idempotent.
    """
    try:
        from jax.experimental.mosaic.gpu import constraints
        from jax.experimental.mosaic.gpu import fragmented_array as fa
        from jax.experimental.mosaic.gpu import utils as mgpu_utils

        original, supported = fa.FragmentedArray.to_layout, constraints._is_supported_tiled_relayout
        layouts_match = (fa.WGMMA_LAYOUT, fa.WGMMA_LAYOUT_8BIT) == _expected_8bit_layouts(fa)
        helpers = all(hasattr(mgpu_utils, name) for name in ("prmt", "bitcast", "vector_concat", "thread_idx", "c"))
    except (ImportError, AttributeError):
        return False
    if getattr(original, "_lowbit_8bit", False):
        return True
    if not (layouts_match and helpers):
        return False

    def to_layout(self, new_layout):
        if (self.layout == fa.WGMMA_LAYOUT and new_layout == fa.WGMMA_LAYOUT_8BIT
                and mgpu_utils.bitwidth(self.mlir_dtype) == 8 and self.shape[1] % 16 == 0):
            return _wgmma_to_8bit(self)
        return original(self, new_layout)

    def is_supported(src, dst, bitwidth):
        return (src == fa.WGMMA_LAYOUT and dst == fa.WGMMA_LAYOUT_8BIT and bitwidth == 8) or supported(
            src, dst, bitwidth)

    to_layout._lowbit_8bit, to_layout._lowbit_original = True, original
    fa.FragmentedArray.to_layout = to_layout
    constraints._is_supported_tiled_relayout = is_supported
    return True


@functools.cache
def relayout_8bit() -> bool:
    """Whether this jax has the WGMMA → WGMMA_8BIT relayout, installed (:func:`_install_8bit_relayout`) on the first
    call: the first compiled Mosaic GPU kernel that takes an INT8 A operand from registers. Importing the package
    changes nothing in JAX; the interpreter never needs it."""
    return _install_8bit_relayout()


def int8_in_registers(interpret: bool) -> bool:
    """Whether :func:`register_operand` keeps INT8 tiles in registers: compiled, with the relayout available
    (the interpreter takes SMEM operands only)."""
    return not interpret and relayout_8bit()


def int8_operand_in_smem(interpret: bool, registers: bool = True) -> bool:
    """Whether :func:`register_operand` stores an INT8 tile to its SMEM ``scratch`` (so the kernel must allocate
    one) rather than relaying it out in registers: always when ``registers`` is False or
    :func:`int8_in_registers` is (interpreted, no relayout, or switched off)."""
    return not (registers and int8_in_registers(interpret))


def register_operand(x: jax.Array, scratch, interpret: bool, *, commit: bool = True, registers: bool = True):
    """``x`` (a WGMMA-layout tile: 16-bit, or INT8 (64, K)) as the register A operand of ``wgmma``.

    A 16-bit tile is used as is; an INT8 one is relaid out to WGMMA_8BIT (:func:`_install_8bit_relayout`; lane
    shuffles). Where the product's B operand can hold its contraction index permuted,
    ``operand_order.register_operand`` takes the tile with no shuffle instead.
    The Mosaic GPU interpreter takes SMEM operands only, and an INT8 tile stays out of registers with
    ``registers=False`` or :func:`int8_in_registers` false (:func:`int8_operand_in_smem`): then ``x`` is
    stored to ``scratch`` (an SMEM tile, which is returned), followed by ``commit_smem`` unless
    ``commit=False`` (the caller then commits once for several stores). Same values either way."""
    if jnp.dtype(x.dtype).itemsize > 1:
        if registers and not interpret:
            return x
    elif not int8_operand_in_smem(interpret, registers):
        return plgpu.layout_cast(x, plgpu.Layout.WGMMA_8BIT)
    scratch[...] = x
    if commit:
        plgpu.commit_smem()
    return scratch


__all__ = ["relayout_8bit", "int8_in_registers", "int8_operand_in_smem", "register_operand"]
