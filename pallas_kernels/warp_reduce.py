"""Reductions across a warpgroup's registers in the Mosaic GPU kernels, warp by warp.

:func:`tile_absmax`: the maximum |x| of a WGMMA-layout tile as a scalar every thread of the warpgroup holds (the
per-tile INT8 scale of SageBwd's dS), compiled as one ``redux.sync`` per warp and four words through the warpgroup's
own SMEM scratch. :func:`column_reduce`: the maximum or sum over the rows of a tile, through the warpgroup's own
scratch too. :func:`warp_any_above`: whether any row of a warp's rows is above a threshold, as one
``vote.sync`` (the SageAttention forward's conditional rescaling). Both are inline Mosaic GPU where compiled and
plain jax.numpy in the interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import stmatrix
from pallas_kernels._mosaic import col_vector, plgpu, warpgroup_barrier

def tile_absmax(x: jax.Array, scratch, interpret: bool) -> jax.Array:
    """max |x| of a (rows, cols) float32 WGMMA-layout tile, as a scalar every thread of the warpgroup holds.
    ``scratch``: this warpgroup's own (rows,) float32 SMEM ref (rows a multiple of 4, as allocated: 16-byte
    aligned). Consecutive calls on one ``scratch`` need, between them, a point that every warp passes only after
    every warp's loads (in the kernels: the SMEM commit of the step's operands, or a ``wgmma`` on the result,
    which starts once all four warps have issued it).

    Mosaic GPU reduces across warps through one SMEM scratch area shared by all
    warpgroups of a CTA, which races when two compute warpgroups reduce at once
    (measured: wrong dS scales on the H200), so the cross-warp step goes through ``scratch``,
    which only this warpgroup reads; a plain warpgroup barrier orders it (``_mosaic.warpgroup_barrier``).
    Compiled: :func:`_warp_absmax` (one ``redux.sync`` per warp and four SMEM words). Interpreted: the row maxima
    written to ``scratch`` and re-read along the lanes.
    """
    if x.ndim != 2 or scratch.shape != (x.shape[0],) or x.shape[0] % 4:
        raise ValueError(f"tile_absmax takes a (rows, cols) tile and a (rows,) scratch, rows a multiple of 4; got "
                         f"{x.shape} and {scratch.shape}")
    x = jnp.abs(x)
    if not interpret:
        return _warp_absmax(x, scratch)
    scratch[...] = jnp.max(x, axis=1)
    warpgroup_barrier(interpret)  # every row max is written
    return tile_absmax_of(scratch, interpret)  # the re-read another warpgroup does, so both give the same bits


def tile_absmax_of(scratch, interpret: bool) -> jax.Array:
    """The value :func:`tile_absmax` returned, re-read from the ``scratch`` it used: by another warpgroup, after a
    barrier both passed once that call was done. Compiled, the maximum of its four warp words; interpreted, of
    its row maxima. The same bits as the call's result (NaN propagates)."""
    if interpret:
        return jnp.max(col_vector(scratch))
    return jnp.maximum(jnp.maximum(scratch[0], scratch[1]), jnp.maximum(scratch[2], scratch[3]))


def _thread_values(arr) -> list:
    """In inline Mosaic GPU: this thread's scalar values of the fragmented array ``arr``, register by register."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import vector

    return [vector.extract(r, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
            for r in arr.registers.flat for i in range(ir.VectorType(r.type).shape[0])]


def _warp_absmax(x: jax.Array, scratch) -> jax.Array:
    """:func:`tile_absmax` of ``x`` = |tile| in inline Mosaic GPU: each thread's maximum of its values (a balanced
    tree of ``max.NaN.f32``), the warp's by one ``redux.sync.max.u32`` on the float bits (order-preserving for
    non-negative floats, NaN above +inf), one word per warp into ``scratch[0:4]``, the warpgroup's named barrier,
    one 16-byte load of the four words and their maximum. Stores, barrier and load are in one inline block, in
    program order."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector
    from jax.experimental import mosaic
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((), jnp.float32, layout=plgpu.Layout.WG_SPLAT(())))
    def _max(ctx, arr, smem):
        del ctx
        f32, i32, i8 = ir.F32Type.get(), ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(8)
        const = lambda v: arith.constant(i32, v)  # noqa: E731
        fmax = lambda a, b: llvm.inline_asm(f32, [a, b], "max.NaN.f32 $0, $1, $2;", "=f,f,f")  # noqa: E731
        values = _thread_values(arr)
        while len(values) > 1:
            values = [fmax(a, b) for a, b in zip(values[::2], values[1::2])] + values[len(values) // 2 * 2:]
        warp_max = mgpu_utils.redux(arith.bitcast(i32, values[0]), const(0xFFFFFFFF),
                                    mgpu_utils.ReductionKind.UMAX)
        warp, _ = stmatrix.warp_and_lane()
        base = mgpu_utils.memref_ptr(smem)
        llvm.store(warp_max, mgpu_utils.getelementptr(base, [(warp << 2).value], i8), alignment=4)
        mgpu_utils.warpgroup_barrier()  # every warp's word is written
        words = llvm.load(ir.VectorType.get((4,), i32), base, alignment=16)

        def pick(i):
            return vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))

        total = arith.maxui(arith.maxui(pick(0), pick(1)), arith.maxui(pick(2), pick(3)))
        return mosaic.gpu.FragmentedArray.splat(arith.bitcast(f32, total), (), is_signed=None)

    return _max(plgpu.layout_cast(x, plgpu.Layout.WGMMA), scratch)


def column_reduce(x: jax.Array, scratch, kind: str, interpret: bool) -> jax.Array:
    """The maximum (``kind="max"``, NaN propagating) or sum (``"sum"``) over the rows of a (64, N) float32
    WGMMA-layout tile, an (N,) vector in ``Layout.WGMMA.reduce(0)``, through this warpgroup's own (4, N) float32 SMEM
    ``scratch``: Mosaic GPU's own cross-warp reduction (``jnp.max(x, axis=0)``) shares one scratch area between the
    warpgroups of a CTA (:func:`tile_absmax`), so two compute warpgroups reducing over rows at once would race.

    Compiled (inline Mosaic GPU): each thread combines its two row halves, three butterfly shuffles over the lane's
    row bits give the warp's result for the thread's column pairs, the warp stores it into row ``warp`` of
    ``scratch`` between two warpgroup barriers (the first orders it after every warp's loads of the previous
    call), and each thread combines the four rows of its columns. Interpreted, by ``jax.numpy``."""
    if kind not in ("max", "sum"):
        raise ValueError(f"kind must be 'max' or 'sum', got {kind!r}")
    if x.ndim != 2 or x.shape[0] != 64 or scratch.shape != (4, x.shape[1]):
        raise ValueError(f"column_reduce takes a (64, N) tile and a (4, N) scratch; got {x.shape} and {scratch.shape}")
    if interpret:
        return jnp.max(x, axis=0) if kind == "max" else jnp.sum(x, axis=0)
    return _column_reduce(x, scratch, kind)


def _column_reduce(x: jax.Array, scratch, kind: str) -> jax.Array:
    """:func:`column_reduce` compiled. The vector's registers: one (2,) float32 piece per 8-column chunk j, this
    thread's columns 8j + 2c, 8j + 2c + 1 (c = lane mod 4), as in the tile's registers."""
    import numpy as np
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental import mosaic
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    n = x.shape[1]
    out_layout = plgpu.Layout.WGMMA.reduce(0)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((n,), x.dtype, layout=out_layout))
    def _reduce(ctx, arr, smem):
        del ctx
        op = arith.maximumf if kind == "max" else arith.addf  # maximumf propagates NaN
        i8 = ir.IntegerType.get_signless(8)
        regs = arr.registers  # index 1: the 8-column chunk j; index 4: the row half
        stmatrix.check_registers(regs.shape, n)
        vector_layout = fa.WGMMA_LAYOUT.reduce((0,))
        if vector_layout.registers_shape((n,)) != (n // 8, 1, 1) or vector_layout.vector_length != 2:
            raise NotImplementedError(f"unexpected register array of an ({n},) WGMMA column vector")
        warp, lane = stmatrix.warp_and_lane()
        c = lane & 3
        base = mgpu_utils.memref_ptr(smem)
        vec_ty = regs.flat[0].type

        def pair_of(w, j):  # the scratch address of warp w's columns 8j + 2c, 8j + 2c + 1
            return mgpu_utils.getelementptr(base, [((w * n + j * 8 + c * 2) * 4).value], i8)

        mgpu_utils.warpgroup_barrier()  # every warp has read the scratch's previous contents
        for j in range(n // 8):
            v = op(regs[0, j, 0, 0, 0, 0, 0, 0, 0], regs[0, j, 0, 0, 1, 0, 0, 0, 0])
            for stride in (4, 8, 16):  # the lane's row bits
                v = op(v, mgpu_utils.shfl_bfly(v, stride))
            llvm.store(v, pair_of(warp, j), alignment=8)  # every lane of a column pair stores the same value
        mgpu_utils.warpgroup_barrier()  # every warp's row is written
        out = np.empty((n // 8, 1, 1), dtype=object)
        for j in range(n // 8):
            parts = [llvm.load(vec_ty, pair_of(w, j), alignment=8) for w in range(4)]
            out[j, 0, 0] = op(op(parts[0], parts[1]), op(parts[2], parts[3]))
        return mosaic.gpu.FragmentedArray(_registers=out, _layout=vector_layout, _is_signed=None)

    return _reduce(plgpu.layout_cast(x, plgpu.Layout.WGMMA), scratch)


def warp_any_above(x: jax.Array, threshold: float, interpret: bool) -> jax.Array:
    """Whether any row value of a (rows,) WGMMA row vector (``Layout.WGMMA.reduce(1)``) exceeds ``threshold``, as a
    bool scalar for ``lax.cond``: compiled, over the rows of this thread's *warp* (16 of a 64-row tile; one
    ``vote.sync.any`` — so the branch is uniform within each warp, and may differ between the warps of a
    warpgroup: only for branches that touch nothing but the warp's own rows' registers); interpreted, over all
    rows (uniform across the warpgroup). NaN counts as not above."""
    if x.ndim != 1:
        raise ValueError(f"warp_any_above takes a (rows,) row vector, got shape {x.shape}")
    if interpret:
        return jnp.any(x > threshold)
    return _warp_vote_above(x, threshold) != 0


def _warp_vote_above(x: jax.Array, threshold: float) -> jax.Array:
    """:func:`warp_any_above` compiled: int32 1 where a row of this thread's warp is above ``threshold``, else 0."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental import mosaic

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA.reduce(1),),
                       return_type=plgpu.ShapeDtypeStruct((), jnp.int32, layout=plgpu.Layout.WG_SPLAT(())))
    def _vote(ctx, arr):
        del ctx
        f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
        values = _thread_values(arr)
        top = values[0]
        for v in values[1:]:  # max.f32 drops a NaN operand: a NaN row does not hide another row's value
            top = llvm.inline_asm(f32, [top, v], "max.f32 $0, $1, $2;", "=f,f,f")
        limit = arith.constant(f32, float(threshold))
        any_above = llvm.inline_asm(
            i32, [top, limit],
            "{ .reg .pred p, q; setp.gt.f32 p, $1, $2; vote.sync.any.pred q, p, 0xffffffff; selp.s32 $0, 1, 0, q; }",
            "=r,f,f", has_side_effects=True)
        return mosaic.gpu.FragmentedArray.splat(any_above, (), is_signed=True)

    return _vote(plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1)))


__all__ = ["tile_absmax", "tile_absmax_of", "column_reduce", "warp_any_above"]
