"""FlashAttention-3's dQ accumulation in the fused Mosaic GPU backwards (SageBwd, Attn-QAT).

Each step's dQ part (dS·K for the step's keys) is added into a float32 accumulator in GMEM by a TMA reduce-add
(``cp.reduce.async.bulk``) from a float32 SMEM stage, instead of a second kernel that recomputes S, P and dP for
dQ. The stage's layout (its swizzle, its 64-column chunks, the permuted column order of conflict-free stores)
is :mod:`pallas_kernels.dq_stage`; here are the accumulator (:func:`reduce_add_accumulator`: zeroed after an
input of the same call, one slice per writer when interpreted, since the Mosaic GPU interpreter has no TMA
reduction), the stage's reuse protocol (:func:`stage_free`, :func:`early_stage_wait`) and the reduce-adds of a
product (:func:`reduce_add_out`, :func:`reduce_add_product`, :func:`reduce_add_matmul`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import dq_stage
from pallas_kernels._mosaic import matmul, pl, plgpu
from pallas_kernels.dq_stage import REDUCE_COLS, stage_transforms





def reduce_add_stage(wgs: int, rows: int, chunks: int = 1) -> plgpu.SMEM:
    """The float32 SMEM stage of :func:`reduce_add_out`, one (rows, REDUCE_COLS) tile per compute warpgroup, or
    with ``chunks`` > 1 one per warpgroup and column chunk of :func:`reduce_add_matmul` ((wgs, chunks, rows,
    REDUCE_COLS)), so a chunk's stage waits only for the previous step's copy of that chunk. Tiled and swizzled
    by :func:`stage_transforms`."""
    shape = (wgs, rows, REDUCE_COLS) if chunks == 1 else (wgs, chunks, rows, REDUCE_COLS)
    return plgpu.SMEM(shape, jnp.float32, transforms=stage_transforms())


def reduce_add_accumulator(shape: tuple, writers: tuple[int, ...], *, interpret: bool, after: jax.Array,
                           zeros: jax.Array | None = None):
    """A zeroed float32 GMEM ref of ``shape`` for :func:`reduce_add_out` to add into (a kernel operand).
    Interpreting (no TMA reduction) it gets one slice per writer, ``writers`` axes prepended: select one
    with :func:`reduce_add_slot`, sum them with :func:`reduce_add_total`.

    ``after``: an input of the same kernel call (the backward's dO). The zero is passed through
    ``lax.optimization_barrier`` together with it, so the buffer cannot be filled before that input
    exists. A plain ``jnp.zeros`` has no operands: in a model's training step XLA merged the zero fills
    of every layer's backward into one multi-output fusion at the start of the backward, so all of them
    were live at once (11 × 80 MiB float32 dQ workspaces in the 50m preset at B16 S2048).

    ``zeros``: a float32 array of ``shape`` that a kernel reading ``after`` wrote as zeros (the SageBwd
    preprocess: ``sage_bwd.sage_bwd_preprocess(zero_dq=True)``), used instead of a separate fill; interpreting,
    each writer's slice starts from it."""
    if zeros is not None:
        if zeros.shape != tuple(shape) or zeros.dtype != jnp.float32:
            raise ValueError(f"zeros: expected float32 {tuple(shape)}, got {zeros.dtype} {zeros.shape}")
        return jax.new_ref(zeros if not interpret else jnp.broadcast_to(zeros, (*writers, *shape)))
    zero, _ = lax.optimization_barrier((jnp.zeros((), jnp.float32), after))
    return jax.new_ref(jnp.broadcast_to(zero, shape if not interpret else (*writers, *shape)))


def reduce_add_slot(ref, writer: tuple, *, interpret: bool):
    """This writer's target in a :func:`reduce_add_accumulator` (all of it unless interpreting)."""
    return ref.at[writer] if interpret else ref


def reduce_add_total(ref, n_writer_axes: int, *, interpret: bool, permuted: bool = False) -> jax.Array:
    """The value of a :func:`reduce_add_accumulator` after the kernel (its slices summed when interpreting; its
    columns put back in order if the kernel's stage was ``permuted``, as :func:`reduce_add_out`)."""
    total = ref[...]
    if interpret:
        return jnp.sum(total, axis=tuple(range(n_writer_axes)))
    return dq_stage.unpermute(total) if permuted else total


def stage_free(pending: int = 0) -> None:
    """Wait (warpgroup-wide) until the TMA reduce-adds from this warpgroup's stage have read it, so the stage may
    be rewritten (:func:`reduce_add_out`): all but the ``pending`` most recent (those read other chunks' stages)."""
    plgpu.wait_smem_to_gmem(pending, wait_read_only=True)


def early_stage_wait(pending: int = 0) -> Callable[[], None]:
    """The ``issued`` hook that frees the dQ stage (:func:`stage_free`, ``pending`` as there) right after the
    step's products are issued, while the tensor cores run them, instead of just before the stage is rewritten;
    pass ``waited=True`` to :func:`reduce_add_out` after it."""
    return functools.partial(stage_free, pending)


def reduce_add_out(stage, value: jax.Array, dst, *, interpret: bool, waited: bool = False,
                   pending: int = 0, permuted: bool = False) -> None:
    """``dst += value`` in GMEM by a TMA reduce-add, through the SMEM ``stage`` (reused once the previous
    copy has read it: :func:`stage_free` here unless ``waited``, i.e. the caller ran it since its last
    reduce-add; the copy is left in flight). Float32 sums in an unspecified order across CTAs.
    The Mosaic GPU interpreter has no TMA reduction: there it is a plain copy, so ``dst`` must be a
    slice of a workspace that only this warpgroup writes, summed by the caller. ``permuted``: the stage's columns in
    ``dq_stage`` order (16-byte stores without bank conflicts; compiled only), to be put back by
    :func:`reduce_add_total` with the same flag."""
    if not waited:
        stage_free(pending)
    if permuted:
        if interpret:
            raise ValueError("permuted: the interpreter has no inline Mosaic GPU for the dQ stage's column order")
        dq_stage.store(stage, value)
    else:
        stage[...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, dst, reduction_op=None if interpret else "add")


def reduce_add_matmul(stage, a, b_cols, width: int, dst, *, interpret: bool, acc_dtype=jnp.float32,
                      factor=None, early: bool = True, permuted: bool = False) -> None:
    """``dst(cols) += (a @ b_cols(cols)) · factor`` for each REDUCE_COLS-wide column chunk of a ``width``-column
    product: FlashAttention-3's dQ accumulation, each step's dS·K added to a float32 dQ in GMEM by TMA
    (:func:`reduce_add_out`, through the float32 ``stage``) instead of a second kernel recomputing S, P
    and dP. ``b_cols(cols)`` is the B operand of those columns; an int32 (INT8) product is converted to
    float32 before ``factor`` (a scalar, or None for none). Chunks keep the stage within SMEM at D128.
    ``stage``: one (rows, REDUCE_COLS) tile that every chunk reuses (each waits for the previous chunk's copy to
    have read it), or one per chunk ((chunks, rows, REDUCE_COLS), :func:`reduce_add_stage`; a chunk waits for
    the previous step's copy of its own). With ``early`` the stage is freed while each chunk's product runs
    (:func:`early_stage_wait`); ``permuted`` as in :func:`reduce_add_out`."""
    per_chunk = len(stage.shape) == 3
    cols = stage.shape[-1]
    chunks = width // cols
    pending = chunks - 1 if per_chunk else 0  # copies issued since this chunk's stage was last read
    hook = early_stage_wait(pending) if early else None
    for c in range(chunks):
        chunk, tile = pl.ds(c * cols, cols), stage.at[c] if per_chunk else stage
        reduce_add_product(tile, matmul(tile.shape, acc_dtype, a, b_cols(chunk), issued=hook), dst(chunk),
                           interpret=interpret, factor=factor, waited=hook is not None, pending=pending,
                           permuted=permuted)


def reduce_add_product(stage, part: jax.Array, dst, *, interpret: bool, factor=None, waited: bool = False,
                       pending: int = 0, permuted: bool = False) -> None:
    """``dst += part · factor`` (:func:`reduce_add_out`) for one product chunk already in registers: an int32
    (INT8) product is converted to float32 first; ``factor`` a scalar, or None for none; ``waited``, ``pending``
    and ``permuted`` as in :func:`reduce_add_out`."""
    part = part.astype(jnp.float32)
    reduce_add_out(stage, part if factor is None else part * factor, dst, interpret=interpret, waited=waited,
                   pending=pending, permuted=permuted)


__all__ = ["REDUCE_COLS", "reduce_add_stage", "reduce_add_accumulator", "reduce_add_slot",
           "reduce_add_total", "stage_free", "early_stage_wait", "reduce_add_out", "reduce_add_matmul",
           "reduce_add_product"]
