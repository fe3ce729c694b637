"""The float32 dQ stage's column order: conflict-free 16-byte stores instead of Mosaic GPU's staggered ones.

The fused backwards (SageBwd, Attn-QAT) add each step's dQ part into a float32 GMEM accumulator by a TMA
reduce-add from a (64 queries × 64 columns) float32 SMEM stage, tiled 8 × 32 with a 128-byte swizzle
(``reduce_add.reduce_add_out``). In the WGMMA register layout a thread holds, for its rows g and g + 8, the column
pairs 8j + 2c, 8j + 2c + 1 (j = 0..7, c = lane mod 4). Stored as they are (8 bytes per lane), a half-warp's
rows g and g + 1 fall in the same banks, so Mosaic GPU staggers the stores (``StaggeredTransferPlan``: a select
per register, 32 per thread and step) and issues 16 ``STS.64``.

Here the stage holds the columns permuted instead (:func:`column_of`): a thread's pairs j = 2k, 2k + 1 are put
side by side as one 16-byte piece k (k = 0..3) at the physical columns 32·(k // 2) + 4·(2c + k mod 2) … + 3.
An 8-lane phase of a 16-byte store then covers rows 2m, 2m + 1 and the four lanes of each row write the
16-byte chunks 2c + k mod 2 of one column tile: four distinct chunk pairs, which the swizzle (an XOR with the
row) keeps distinct, so no bank is hit twice; 8 ``STS.128`` per thread and step, no selects. The TMA copies the
stage as it is, so the GMEM accumulator holds every 64-column chunk in that order, and :func:`unpermute` (a
reshape and a transpose, which XLA fuses into dQ's conversion to 16 bits) puts it back.

Only compiled (the Mosaic GPU interpreter has no inline Mosaic GPU); by default the kernels take it at head dim 64,
where it measured faster (``reduce_add.reduce_add_out(permuted=)``, ``reduce_add_total(permuted=)``;
docs/performance.md): at 128 unsplit the extra registers made ptxas spill (:func:`permutes`' ``order``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import stmatrix
from pallas_kernels._mosaic import plgpu
from pallas_kernels.configs import DQ_STAGE_ORDERS

#: columns of one TMA reduce-add chunk (128 bytes of a 16-bit row: one swizzle width, so a column
#: slice of a K tile is a valid ``wgmma`` B operand); the permuted order below is made for 64
REDUCE_COLS = 64


def stage_transforms() -> tuple:
    """SMEM tiling + swizzle of the float32 stage: a 128-byte swizzle, tiled 8 rows × 32 floats (a narrower
    swizzle avoids the staggered stores but makes the TMA reduce-add copy eight boxes instead of two: slower)."""
    return (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


#: byte strides of the (64, 64) float32 stage tiled (8, 32): (row tile, column tile, row)
STRIDES = (2 * 8 * 128, 8 * 128, 128)


def permutes(head_dim: int, interpret: bool, order: str = "auto") -> bool:
    """Whether a fused backward's dQ stage holds the permuted column order (``order``, the configs'
    ``dq_stage_order``): never interpreted; "auto" at head dim 64, "permuted" wherever each warpgroup stores one
    (rows, 64) tile a step (head dim 64, and 128 split by columns), "natural" never."""
    if order not in DQ_STAGE_ORDERS:
        raise ValueError(f"order must be one of {DQ_STAGE_ORDERS}, got {order!r}")
    if interpret or order == "natural":
        return False
    return order == "permuted" or head_dim <= REDUCE_COLS


def column_of(d):
    """The stage column (0..63) that holds dQ column ``d`` of a 64-column chunk (ints or numpy arrays):
    d = 16k + 8h + 2c + b → 32·(k // 2) + 4·(2c + k mod 2) + 2h + b."""
    k, h, c, b = d // 16, (d // 8) % 2, (d // 2) % 4, d % 2
    return 32 * (k // 2) + 4 * (2 * c + k % 2) + 2 * h + b


def unpermute(x: jax.Array) -> jax.Array:
    """``x`` (…, D) with each 64-column chunk of its last axis in :func:`column_of` order, put back in natural
    order: stage column 32·k2 + 8c + 4·k1 + 2h + b holds dQ column 32·k2 + 16·k1 + 8h + 2c + b."""
    *lead, d = x.shape
    if d % REDUCE_COLS:
        raise ValueError(f"the dQ stage's order needs a multiple of {REDUCE_COLS} columns, got {d}")
    split = x.reshape(*lead, d // REDUCE_COLS, 2, 4, 2, 2, 2)  # (chunk, k2, c, k1, h, b)
    n = len(lead) + 1
    order = (*range(n), n, n + 2, n + 3, n + 1, n + 4)  # → (chunk, k2, k1, h, c, b)
    return jnp.transpose(split, order).reshape(*lead, d)


def piece_offset(warp, half: int, g, c, k: int):
    """The stage byte offset of piece ``k`` (0..3: the column blocks 2k, 2k + 1) of row half ``half`` that lane
    4g + c of ``warp`` stores: row tile 2·warp + half, row g, column tile k // 2, 16-byte chunk 2c + k mod 2 under
    the 128-byte swizzle. :class:`pallas_kernels.stmatrix.Int` s in :func:`store`; numpy arrays in tests."""
    tile_bytes, col_tile_bytes, row_bytes = STRIDES
    row = (warp * 2 + half) * tile_bytes + g * row_bytes
    return stmatrix.swizzled(row + (k // 2) * col_tile_bytes, c * 2 + (k % 2), 128)


def store(stage, value: jax.Array) -> None:
    """``stage`` = ``value`` (a (64, 64) float32 WGMMA-layout tile) with the columns in :func:`column_of` order:
    8 conflict-free 16-byte stores per thread (inline Mosaic GPU; compiled only)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm, vector
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    layout = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType(stage_transforms())))
    def _store(ctx, arr, smem):
        del ctx
        _, strides, warp, hi, lo, base = stmatrix.lane_context(smem)
        if strides != STRIDES:
            raise NotImplementedError(f"the permuted dQ stage needs a 128-byte swizzled (8, 32) float32 tiling of a "
                                      f"(64, 64) stage, byte strides {STRIDES}; got {strides}")
        lane = (hi << 3) | lo
        g, c = lane >> 2, lane & 3
        regs = arr.registers  # index 1: the 8-column block j; index 4: the row half
        stmatrix.check_registers(regs.shape, REDUCE_COLS)
        for half in (0, 1):
            for k in range(4):
                offset = piece_offset(warp, half, g, c, k)
                piece = vector.shuffle(regs[(0, 2 * k, 0, 0, half, 0, 0, 0, 0)],
                                       regs[(0, 2 * k + 1, 0, 0, half, 0, 0, 0, 0)], [0, 1, 2, 3])
                ptr = mgpu_utils.getelementptr(base, [offset.value], ir.IntegerType.get_signless(8))
                llvm.store(piece, ptr, alignment=16)

    _store(plgpu.layout_cast(value, layout), stage)


def byte_offsets(k: int, half: int, warp: int = 0) -> np.ndarray:
    """The stage byte offset each lane (0..31) of ``warp`` writes in store ``k`` of row half ``half`` of
    :func:`store`: :func:`piece_offset` on numpy lanes, for tests."""
    lanes = np.arange(32)
    return piece_offset(warp, half, lanes // 4, lanes % 4, k)
