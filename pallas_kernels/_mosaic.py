"""The Mosaic GPU backend of Pallas behind one small module (the Hopper path).

Counterpart of :mod:`pallas_kernels._triton`: kernel files import their
backend-specific pieces from here — compiler parameters, shared-memory tile
transforms, row/column broadcasts in the WGMMA register layout, the interpret
switch — so the kernels read as plain tile math.

Mosaic GPU exposes what the Triton lowering hides on Hopper: explicit ``wgmma``
(INT8 × INT8 → INT32 included), TMA copies and warp specialisation (one memory
warpgroup feeding two compute warpgroups). INT8 ``wgmma`` needs both operands
K-major (the contraction dim contiguous): the ``B`` operand is always a
transposed view of a tile stored with the contraction dim last.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

#: Registers left to the memory (TMA-issuing) warpgroup; the compute ones get the rest.
MEMORY_REGISTERS = 40


def compiler_params() -> plgpu.CompilerParams:
    """Mosaic GPU compiler parameters (fast approximate exp2/reciprocal)."""
    return plgpu.CompilerParams(approx_math=True)


def interpret_params(interpret: bool):
    """``interpret=`` argument of ``plgpu.kernel``: the Mosaic GPU interpreter on the CPU."""
    return plgpu.InterpretGPUParams() if interpret else None


def tile_transforms(dtype, cols: int) -> tuple:
    """SMEM tiling + swizzle for a 2-D tile whose rows hold ``cols`` elements of ``dtype``.

    The swizzle is the row's byte width capped at 128 (what ``wgmma`` and TMA
    both accept); the tiling is 8 rows × one swizzle width of elements.
    """
    width = cols * jnp.dtype(dtype).itemsize
    swizzle = min(128, width)
    if swizzle not in (32, 64, 128):
        raise ValueError(f"a {cols}-column {jnp.dtype(dtype).name} tile has no valid swizzle (row of {width} bytes)")
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def rows_of(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Broadcast a per-row vector (length shape[0]) over a tile."""
    return lax.broadcast_in_dim(vec, shape, [0])


def cols_of(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Broadcast a per-column vector (length shape[1]) over a tile."""
    return lax.broadcast_in_dim(vec, shape, [1])


def row_vector(ref) -> jax.Array:
    """Load a 1-D SMEM vector laid out along the rows of a WGMMA tile."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))


def col_vector(ref) -> jax.Array:
    """Load a 1-D SMEM vector laid out along the columns of a WGMMA tile."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0))


def tile_max(x: jax.Array, scratch) -> jax.Array:
    """Maximum of a 2-D WGMMA-layout tile, as a scalar every thread of the warpgroup holds.

    Mosaic GPU reduces across warps through one SMEM scratch area shared by all
    warpgroups of a CTA, which races when two compute warpgroups reduce at once
    (measured: wrong dS scales on the H200). Here the row maxima go through this
    warpgroup's own ``scratch`` (a (rows,) float32 SMEM ref) and are re-read along
    the lanes, so the last reduction stays inside each warp.
    """
    scratch[...] = jnp.max(x, axis=1)
    plgpu.commit_smem()  # fence + warpgroup barrier: every row max is written
    return jnp.max(col_vector(scratch))


def matmul(acc_shape: tuple[int, int], acc_dtype, a, b) -> jax.Array:
    """``a @ b`` on the tensor cores (``a`` SMEM or registers, ``b`` SMEM), as a fresh array."""

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(acc_shape, acc_dtype))


def matmul_pair(shapes: tuple, dtypes: tuple, operands: tuple, *, fused: bool) -> tuple[jax.Array, jax.Array]:
    """Two independent products ``a0 @ b0`` and ``a1 @ b1``.

    ``fused`` issues both ``wgmma`` groups before one wait (the tensor cores run them
    back to back); otherwise one after the other, each waited. The Mosaic GPU
    interpreter only runs the second form (same values).
    """
    (a0, b0), (a1, b1) = operands
    if not fused:
        return matmul(shapes[0], dtypes[0], a0, b0), matmul(shapes[1], dtypes[1], a1, b1)

    def body(refs):
        plgpu.wgmma(refs[0], a0, b0)
        plgpu.wgmma(refs[1], a1, b1)

    zeros = [plgpu.layout_cast(jnp.zeros(s, dt), plgpu.Layout.WGMMA) for s, dt in zip(shapes, dtypes)]
    return pl.run_state(body)(tuple(plgpu.ACC.init(z) for z in zeros))


def compute_pipeline(step, compute, in_specs, steps: int, *, compute_wgs: int = 2, stages: int = 2):
    """A warp-specialised pipeline: one memory warpgroup streams ``in_specs`` tiles for
    ``steps`` steps into ``stages`` SMEM buffers; ``compute_wgs`` warpgroups run
    ``step(index, *tiles, *consumed_barriers, carry) -> carry`` (each must arrive on the
    consumed barriers) inside ``compute(pipeline)`` (their prologue and epilogue)."""
    return plgpu.emit_pipeline_warp_specialized(
        step, grid=(steps,), max_concurrent_steps=stages, num_compute_wgs=compute_wgs,
        memory_registers=MEMORY_REGISTERS, wg_axis="wg", manual_consumed_barriers=True,
        compute_context=compute, in_specs=in_specs)


def key_step_specs(block: int, head_dim: int) -> list:
    """BlockSpecs of one key step's K̂ (block, D) int8 tile and its (block,) scales, step j → keys j·block…"""
    return [plgpu.BlockSpec((block, head_dim), lambda j: (j, 0), transforms=tile_transforms(jnp.int8, head_dim)),
            plgpu.BlockSpec((block,), lambda j: (j,))]


def transposed_step_spec(block: int, head_dim: int, dtype=jnp.int8):
    """BlockSpec of a (D, block) tile of a transposed (D, S) array (K̂ᵀ, V̂ᵀ), step j → columns j·block…"""
    return plgpu.BlockSpec((head_dim, block), lambda j: (0, j), transforms=tile_transforms(dtype, block))


def copy_in(copies, barriers, wg) -> None:
    """Start the TMA copies ``(src, dst)`` of this warpgroup (barrier i, wg), then wait for all."""
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, barriers.at[i, wg])
    for i in range(len(copies)):
        plgpu.barrier_wait(barriers.at[i, wg])


def on_hopper() -> bool:
    """True when the default device is an sm_90 GPU (H100/H200), where these kernels run."""
    if jax.default_backend() not in ("gpu", "cuda"):
        return False
    return getattr(jax.devices()[0], "compute_capability", "") == "9.0"


__all__ = ["pl", "plgpu", "compiler_params", "interpret_params", "tile_transforms", "rows_of", "cols_of",
           "row_vector", "col_vector", "tile_max", "matmul", "matmul_pair", "compute_pipeline", "key_step_specs",
           "transposed_step_spec", "copy_in", "on_hopper",
           "MEMORY_REGISTERS"]
