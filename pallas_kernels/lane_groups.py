"""FP4 groups of P held by one thread: the key order of the Mosaic GPU Attn-QAT kernels.

In a WGMMA accumulator tile (64 rows × n columns) each thread holds, per row it owns, the columns
``8j + 2t + e`` (j < n/8, t its lane in the quad, e ∈ {0, 1}). FQ(P)'s groups are 16 consecutive keys
of a row; with keys in their natural order a group spans the four threads of a quad, so its maximum
takes two lane shuffles and every thread of the quad computes the same e4m3 scale (per thread and row:
n/16 group scales, four values each).

Here the kernels' K̃ and Ṽ rows are stored in *lane order*: within every block of 64 keys, position
``c = 8j + 2t + e`` holds key ``16t + 2j + e``. A thread's 16 columns of a 64-column block are then
exactly one group: its maximum is a reduction over the thread's own registers (no shuffle), and the
scale needs computing only once per thread, row and group (n/64 per row; :func:`group_max`). The softmax
sums and both products contract over the keys in whatever order they are stored, so the values are the
reference's (up to accumulation order): the groups are the same 16 keys. Masks map a column to its key with
:func:`key_of_column` (:func:`column_of_key` is its inverse: where the operand pass stores each key); the
backward's dK/dV rows go back to key order as they are stored to SMEM (``stmatrix.store_rows``;
:func:`from_lane_order` is the same permutation in XLA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.numerics import nvfp4
from pallas_kernels._mosaic import plgpu, swap_within_blocks

#: keys per lane-order block (four lanes × 16 keys)
BLOCK = 64


def _reorder(x: jax.Array, axis: int, split: tuple[int, int]) -> jax.Array:
    return swap_within_blocks(x, axis, (*split, 2), "lane order")


def to_lane_order(x: jax.Array, axis: int) -> jax.Array:
    """Keys along ``axis`` (a multiple of 64) reordered so that position ``8j + 2t + e`` of each 64-block holds
    key ``16t + 2j + e`` of that block (XLA: one transpose)."""
    return _reorder(x, axis, (4, 8))


def from_lane_order(x: jax.Array, axis: int) -> jax.Array:
    """The inverse of :func:`to_lane_order`."""
    return _reorder(x, axis, (8, 4))


def key_of_column(col: jax.Array) -> jax.Array:
    """The key offset (from the tile's first key) stored at column ``col`` of a lane-ordered tile (int32)."""
    return ((col & ~(BLOCK - 1)) | (((col >> 1) & 3) << 4) | (((col >> 3) & 7) << 1) | (col & 1))


def column_of_key(key: jax.Array) -> jax.Array:
    """The column of a lane-ordered tile that holds key offset ``key`` (the inverse of :func:`key_of_column`)."""
    return ((key & ~(BLOCK - 1)) | (((key >> 1) & 7) << 3) | (((key >> 4) & 3) << 1) | (key & 1))


def group_max(x: jax.Array, interpret: bool) -> jax.Array:
    """For a (64, n) float32 WGMMA-layout tile of lane-ordered keys (n a multiple of 64): each element replaced
    by its FP4 group's maximum, the maximum over the 16 columns a thread holds of that row and 64-column block.

    Compiled: inline Mosaic GPU over the thread's registers (register index 1 is the 8-column chunk j,
    index 4 the row half; each register holds the pair e), one splat per group, so the group scale that
    follows runs on identical registers, which common-subexpression elimination can merge into one
    computation per group. Interpreted (the interpreter has no inline Mosaic GPU): the same maxima by a reshape.
    """
    rows, n = x.shape
    if n % BLOCK:
        raise ValueError(f"group_max needs a multiple of {BLOCK} columns, got {x.shape}")
    if interpret:
        g = x.reshape(rows, n // BLOCK, 8, 4, 2)
        g = jnp.broadcast_to(jnp.max(g, axis=(2, 4), keepdims=True), g.shape).reshape(rows, n)
        return g
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, vector
    from jax.experimental.mosaic import gpu as mgpu

    layout = plgpu.Layout.WGMMA
    x = plgpu.layout_cast(x, layout)

    tile_type = plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=layout)

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=tile_type)
    def _max(ctx, arr):
        del ctx
        regs = arr.registers
        groups: dict[tuple, list] = {}
        for idx in np.ndindex(regs.shape):
            key = idx[:1] + (idx[1] // (BLOCK // 8),) + idx[2:]
            groups.setdefault(key, []).append(idx)
        out = np.empty(regs.shape, dtype=object)
        for members in groups.values():
            vals = [regs[i] for i in members]
            while len(vals) > 1:  # a tree of element-wise maxima over the group's registers
                vals = [arith.maximumf(a, b) for a, b in zip(vals[::2], vals[1::2])] + vals[len(vals) & ~1:]
            pair = vals[0]
            lanes = [vector.extract(pair, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
                     for i in range(ir.VectorType(pair.type).shape[0])]
            top = lanes[0]
            for lane in lanes[1:]:
                top = arith.maximumf(top, lane)
            splat = vector.broadcast(pair.type, top)
            for i in members:
                out[i] = splat
        return mgpu.FragmentedArray(_registers=out, _layout=arr.layout, _is_signed=arr.is_signed)

    return _max(x)


def _per_register(text: str, operands: tuple) -> jax.Array:
    """One inline PTX instruction ``text`` per 32-bit register of (64, n) 16-bit tiles in the WGMMA layout
    (compiled only; inline Mosaic GPU): ``$0`` the result register (the first tile's dtype), ``$1…`` the operands
    in order, each a tile (its register) or a Python int (a 32-bit constant, which ptxas keeps in a register
    outside the loop where the instruction has no room for it)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm
    from jax.experimental.mosaic import gpu as mgpu

    layout = plgpu.Layout.WGMMA
    tiles = [plgpu.layout_cast(x, layout) for x in operands if not isinstance(x, int)]
    first = tiles[0]

    @plgpu.inline_mgpu(arg_types=(layout,) * len(tiles),
                       return_type=plgpu.ShapeDtypeStruct(first.shape, first.dtype, layout=layout))
    def _asm(ctx, *arrays):
        del ctx
        reg_type = arrays[0].registers.flat[0].type
        if ir.VectorType(reg_type).shape != [2]:
            raise ValueError(f"{text!r} expects 16-bit pairs per register, got {reg_type}")
        i32 = ir.IntegerType.get_signless(32)
        consts = {i: arith.constant(i32, x - (1 << 32) if x >= 1 << 31 else x)
                  for i, x in enumerate(operands) if isinstance(x, int)}
        out = np.empty(arrays[0].registers.shape, dtype=object)
        for idx in np.ndindex(out.shape):
            regs = iter(a.registers[idx] for a in arrays)
            args = [consts[i] if i in consts else llvm.bitcast(i32, next(regs)) for i in range(len(operands))]
            packed = llvm.inline_asm(i32, args, text, ",".join(["=r"] + ["r"] * len(args)))
            out[idx] = llvm.bitcast(reg_type, packed)
        return mgpu.FragmentedArray(_registers=out, _layout=arrays[0].layout, _is_signed=arrays[0].is_signed)

    return _asm(*tiles)


def packed_fma(a: jax.Array, k: float, c: jax.Array) -> jax.Array:
    """a·k + c rounded once, for (64, n) bfloat16 tiles in the WGMMA layout (compiled only): inline Mosaic GPU,
    one PTX ``fma.rn.bf16x2`` per register (HFMA2 in SASS). Not ``math.fma``: Mosaic GPU's LLVM computes that
    one in float32 and converts back, which made the Attn-QAT forward 28% slower)."""
    if jnp.dtype(a.dtype) != jnp.dtype(jnp.bfloat16) or jnp.dtype(c.dtype) != jnp.dtype(jnp.bfloat16):
        raise TypeError(f"packed_fma needs bfloat16 tiles, got {a.dtype} and {c.dtype}")
    factor_bf16 = np.array(k, dtype=jnp.bfloat16)
    if float(factor_bf16) != k:
        raise ValueError(f"packed_fma's factor must be a bfloat16 value, got {k}")
    bits = int(factor_bf16.view(np.uint16))
    return _per_register("fma.rn.bf16x2 $0, $1, $2, $3;", (a, bits << 16 | bits, c))


def e4m3_by_conversion(x: jax.Array, interpret: bool) -> jax.Array:
    """Non-negative finite float32 rounded to e4m3 as :func:`pallas_kernels.numerics.nvfp4.e4m3_round` does (nearest
    even,
    saturating at 448), by converting to ``float8_e4m3fn`` and back: compiled, PTX ``cvt.rn.satfinite.e4m3x2.f32``
    and ``cvt.rn.f16x2.e4m3x2`` for two values (instead of the magic-number rounding's seven operations);
    interpreted, XLA's conversion, which gives NaN past 464 instead of saturating, so the input is clamped first."""
    if interpret:
        x = jnp.minimum(x, nvfp4.E4M3_MAX)
    return x.astype(jnp.float8_e4m3fn).astype(jnp.float32)


def _per_value(text: str, x: jax.Array) -> jax.Array:
    """One inline PTX ``text`` ($0 ← $1, float32) per value of a float32 WGMMA-layout tile (compiled only): a lane's
    block depends on that value alone, so equal values (a splat register's two lanes) give one block after LLVM's
    common-subexpression elimination."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.mosaic import gpu as mgpu

    layout = plgpu.Layout.WGMMA
    x = plgpu.layout_cast(x, layout)

    def one(value):
        return llvm.inline_asm(ir.F32Type.get(), [value], text, "=f,f")

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=layout))
    def _asm(ctx, arr):
        del ctx
        return arr._pointwise(mgpu.FragmentedArray._lift_fast_instr(one))

    return _asm(x)


def approx_reciprocal(x: jax.Array, interpret: bool) -> jax.Array:
    """1/x of a float32 tile: compiled (inline Mosaic GPU, WGMMA layout) PTX ``rcp.approx.ftz.f32``, at most 1 ulp off
    (one MUFU.RCP instead of a correctly rounded division's ~8 instructions and its branch); interpreted, ``1 / x``.
    Enough where only bf16(1/x) of an e4m3 x is used (:func:`pallas_kernels.numerics.nvfp4.fake_quant_bf16`)."""
    return 1.0 / x if interpret else _per_value("rcp.approx.ftz.f32 $0, $1;", x)


def fake_quant_p(p: jax.Array, interpret: bool, *, times: jax.Array | None = None, dtype=None,
                 fma: bool = False, fast_scale: bool = False) -> jax.Array:
    """P̃ of a (64, n) tile of non-negative finite probabilities with lane-ordered keys, groups of 16 keys per row
    (:func:`group_max`). The values of :func:`pallas_kernels.numerics.nvfp4.fake_quant_probabilities` (the
    references' twin) for the same ``dtype``.

    Args:
      p: (64, n) float32.
      times: a factor of p's shape that is constant along each FP4 group (a row's 1/l): the result is then
        e2m1 · (sf · times), the product taken once per group.
      dtype: the 16-bit dtype of the result (float32 if None). bfloat16: P rounded to bf16
        and quantized in packed bf16 arithmetic (:func:`pallas_kernels.numerics.nvfp4.fake_quant_bf16`), about half
        the float32 quantizer's instructions. Otherwise the float32 quantizer, then converted.
      fma: bfloat16, compiled: e2m1 rounding's two magic-number steps as :func:`packed_fma` (the same values; a
        packed multiply fewer per two elements than ptxas makes of ``a * k + c``, which it does not contract).
      fast_scale: bfloat16: each group's scale by conversion instructions (:func:`e4m3_by_conversion`) and
        its reciprocal approximately (:func:`approx_reciprocal`); the same values.
    Returns:
      (64, n) in ``dtype``.
    """
    if dtype is not None and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        h = p.astype(jnp.bfloat16)
        fast = dict(to_e4m3=lambda x: e4m3_by_conversion(x, interpret),
                    reciprocal=lambda x: approx_reciprocal(x, interpret)) if fast_scale else {}
        return nvfp4.fake_quant_bf16(h, group_max(h, interpret), times=times,
                                     fma=packed_fma if fma and not interpret else None, **fast)
    values, scale = nvfp4.fake_quant_parts(p, group_max(p, interpret), nonnegative=True, assume_finite=True,
                                           times=times)
    out = values * scale
    return out if dtype is None else out.astype(dtype)
