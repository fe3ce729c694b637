"""The Triton backend of Pallas behind one small module.

Every kernel file imports its backend-specific pieces from here (compiler
parameters, masked tile loads/stores, the lowering-warning filter, the inline-PTX
e2m1 decode), so another Pallas backend could be added beside this one.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
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


#: The e2m1 → float16 bit placement of :func:`pallas_kernels.numerics.nvfp4.e2m1_decode_f16` on two 16-bit lanes at
#: once: a lane holding a packed byte in its low 8 bits, shifted left by the first number, has that nibble's
#: exponent and mantissa bits at fp16 bits 11..9 (mask ``E2M1_LANE_MAGNITUDE``); shifted by the second, its
#: sign at bit 15 (mask ``E2M1_LANE_SIGN``). Keys: the byte's low and high nibble.
E2M1_LANE_SHIFTS = {"lo": (9, 12), "hi": (5, 8)}
E2M1_LANE_MAGNITUDE, E2M1_LANE_SIGN = 0x0E000E00, 0x80008000
#: prmt selectors spreading bytes (0, 1) and (2, 3) of a word into the low bytes of its two 16-bit lanes
_SPREAD = ("0x4140", "0x4342")


def _e2m1_unpack_asm(key: str) -> str:
    """PTX for four packed bytes ($2) → the values of their low (``key="lo"``) or high nibbles ($0, $1), two
    fp16 a register, element 0 in the low half (Triton's packing of ``pack=4``)."""
    mag, sign = E2M1_LANE_SHIFTS[key]
    lines = ["{", ".reg .b32 x, t, u;"]
    for pair, selector in enumerate(_SPREAD):
        lines += [f"prmt.b32 x, $2, 0, {selector};",
                  f"shl.b32 t, x, {mag};", f"and.b32 t, t, {E2M1_LANE_MAGNITUDE:#010x};",
                  f"shl.b32 u, x, {sign};", f"and.b32 u, u, {E2M1_LANE_SIGN:#010x};", f"or.b32 ${pair}, t, u;"]
    return "\n".join(lines + ["}"])


def e2m1_lanes_model(lanes: np.ndarray, key: str) -> np.ndarray:
    """numpy model of one placement of :func:`_e2m1_unpack_asm`: uint32 words whose 16-bit lanes hold a
    packed byte each (low 8 bits) → the words of two fp16 bit patterns (tests hold it to
    :func:`pallas_kernels.numerics.nvfp4.e2m1_decode_f16`)."""
    mag, sign = E2M1_LANE_SHIFTS[key]
    w = lanes.astype(np.uint32)
    return ((w << np.uint32(mag)) & np.uint32(E2M1_LANE_MAGNITUDE)) | (
        (w << np.uint32(sign)) & np.uint32(E2M1_LANE_SIGN))


def e2m1_unpack_f16(packed: jax.Array, *, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """In-kernel decode of packed e2m1 bytes into float16 ``value · 2**-14``: (low nibbles, high nibbles).

    The values of :func:`pallas_kernels.numerics.nvfp4.e2m1_unpack` then ``e2m1_decode_f16`` on each half, bit for
    bit. Compiled, four bytes at a time in inline PTX (per nibble half: a byte permute, then the bit placement on
    two 16-bit lanes per 32-bit operation: about 3 instructions a value instead of 6); interpreted (the CPU has no
    PTX), by those two functions.

    Args:
      packed: uint8 or int8 (rows, cols) tile, two codes a byte.
      interpret: the kernel runs in Pallas interpret mode.
    Returns:
      two float16 (rows, cols) tiles.
    """
    if interpret:
        lo, hi = nvfp4.e2m1_unpack(packed)
        return nvfp4.e2m1_decode_f16(lo), nvfp4.e2m1_decode_f16(hi)
    out = [jax.ShapeDtypeStruct(packed.shape, jnp.float16)]  # Pallas lowers single-result asm only
    return tuple(plgpu.elementwise_inline_asm(_e2m1_unpack_asm(key), args=[packed], constraints="=r,=r,r", pack=4,
                                              result_shape_dtypes=out)[0] for key in ("lo", "hi"))


def on_gpu() -> bool:
    """True when the default JAX backend is a CUDA/ROCm GPU."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


__all__ = ["pl", "plgpu", "compiler_params", "row_mask", "load_rows", "store_rows", "on_gpu", "e2m1_unpack_f16"]
