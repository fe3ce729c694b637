"""The Triton backend of Pallas behind one small module.

Every kernel file imports its backend-specific pieces from here (compiler
parameters, masked tile loads/stores, the lowering-warning filter, the inline-PTX
e2m1 decode), so another Pallas backend could be added beside this one.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.numerics import nvfp4

# The Triton backend warns (DeprecationWarning, "jax-pallas-triton") on every
# lowering; users of this library should not see it once per kernel call.
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"jax\._src\.pallas.*")
warnings.filterwarnings("ignore", message=r".*[Tt]riton.*deprecat.*", category=DeprecationWarning)


def compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """Triton compiler parameters for ``pl.pallas_call``."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def row_mask(start: jax.Array | int, rows: int, limit: int) -> jax.Array:
    """bool (rows, 1): ``start + r < limit`` for each row r of a tile."""
    return (start + jnp.arange(rows, dtype=jnp.int32) < limit)[:, None]


def load_rows(ref, valid: jax.Array | None, other: float = 0.0) -> jax.Array:
    """Load a tile, masking rows outside the array (jax 0.11.2 does not mask)."""
    if valid is None:
        return ref[...]
    return plgpu.load(ref, mask=valid, other=other)


def store_rows(ref, value: jax.Array, valid: jax.Array | None) -> None:
    """Store a tile, skipping rows outside the array."""
    if valid is None:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=valid)


#: prmt selectors placing bytes (0, 1) and (2, 3) of a word in the high bytes of its two 16-bit lanes (the low
#: bytes zero)
E2M1_SPREAD = ("0x1404", "0x3424")
E2M1_LANE_MAGNITUDE, E2M1_LANE_SIGN = 0x0E000E00, 0x80008000


def e2m1_lane_ptx(dst: str, word: str, key: str) -> list[str]:
    """PTX lines: a spread word (two cache bytes in its lanes' high bytes, :data:`E2M1_SPREAD`) → ``dst``, the
    fp16 pair ``value · 2**-14`` of the bytes' first (``key="lo"``) or second (``"hi"``) elements, the bit
    placement of :func:`pallas_kernels.numerics.nvfp4.e2m1_decode_f16` on two lanes at once. The byte layout
    (:func:`pallas_kernels.numerics.nvfp4.pack_pair`) puts the first element's bits where fp16 wants them (one
    mask); the second's magnitude is three bits up and its sign seven down (scratch registers ``t``, ``u``)."""
    if key == "lo":
        return [f"and.b32 {dst}, {word}, {E2M1_LANE_MAGNITUDE | E2M1_LANE_SIGN:#010x};"]
    return [f"shr.b32 t, {word}, 3;", f"and.b32 t, t, {E2M1_LANE_MAGNITUDE:#010x};",
            f"shl.b32 u, {word}, 7;", f"and.b32 u, u, {E2M1_LANE_SIGN:#010x};", f"or.b32 {dst}, t, u;"]


def _e2m1_unpack_asm(key: str) -> str:
    """PTX for four cache bytes ($2) → the values of their first (``key="lo"``) or second (``"hi"``) elements ($0,
    $1), two fp16 a register, byte 0's in the low half (Triton's packing of ``pack=4``)."""
    lines = ["{", ".reg .b32 x, t, u;"]
    for pair, selector in enumerate(E2M1_SPREAD):
        lines += [f"prmt.b32 x, $2, 0, {selector};", *e2m1_lane_ptx(f"${pair}", "x", key)]
    return "\n".join(lines + ["}"])


def e2m1_unpack_f16(packed: jax.Array, *, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """In-kernel decode of cache bytes (:func:`pallas_kernels.numerics.nvfp4.pack_halves`) into float16
    ``value · 2**-14``: (first elements, second elements).

    The values of :func:`pallas_kernels.numerics.nvfp4.unpack_pair` then ``e2m1_decode_f16`` on each, bit for
    bit. Compiled, four bytes at a time in inline PTX (per half: a byte permute, then :func:`e2m1_lane_ptx` on two
    16-bit lanes per 32-bit operation: one mask for the first elements, five operations for the second);
    interpreted (the CPU has no PTX), by those two functions.

    Args:
      packed: uint8 or int8 (rows, cols) tile, two codes a byte.
      interpret: the kernel runs in Pallas interpret mode.
    Returns:
      two float16 (rows, cols) tiles.
    """
    if interpret:
        lo, hi = nvfp4.unpack_pair(packed)
        return nvfp4.e2m1_decode_f16(lo), nvfp4.e2m1_decode_f16(hi)
    out = [jax.ShapeDtypeStruct(packed.shape, jnp.float16)]  # Pallas lowers single-result asm only
    return tuple(plgpu.elementwise_inline_asm(_e2m1_unpack_asm(key), args=[packed], constraints="=r,=r,r", pack=4,
                                              result_shape_dtypes=out)[0] for key in ("lo", "hi"))


def on_gpu() -> bool:
    """True when the default JAX backend is a CUDA/ROCm GPU."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


__all__ = ["pl", "plgpu", "compiler_params", "row_mask", "load_rows", "store_rows", "on_gpu", "e2m1_unpack_f16"]
