"""NVFP4 φ: e2m1 values with one e4m3 scale per 16 contiguous elements.

docs/spec.md ("Quantizers"): for each group of 16 elements along the axis of
the product it feeds, ``sf = e4m3(amax / 6)`` (round to nearest even; a zero
group gets ``sf = 1``); values ``e2m1 = rne(x · (1/sf))`` (one reciprocal per group, as
NVIDIA's encoders do) on the grid
{0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign, saturating at ±6; dequantized value
``e2m1 · sf`` (exact in bf16). Storage: two 4-bit codes per uint8 (element 2i in
the low nibble, 2i+1 in the high nibble) plus one e4m3 byte per group —
0.5625 bytes per value.

The element functions (:func:`e4m3_round`, :func:`e2m1_round`,
:func:`e2m1_code`, :func:`e2m1_decode`) use only shifts, compares, selects,
bitcasts and the magic-number rounding, so kernels can call them on tiles.

Non-finite input: NaN or ±inf anywhere in a group makes that group's scale NaN
(e4m3fn has no infinity), so the whole group dequantizes to NaN and the error
stays visible instead of being rounded away. Finite scales above 448 (e4m3's
largest finite value) saturate to 448.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_E4M3_MIN_NORMAL = 2.0**-6  # below it e4m3 is subnormal, with the step of [2**-6, 2**-5): 2**-9
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _exponent_floor(x: jax.Array) -> jax.Array:
    """2**floor(log2 x) for normal non-negative float32 x (0 for 0 and subnormals), by masking the bits."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jax.lax.bitcast_convert_type(bits & 0x7F800000, jnp.float32)


_MAGIC = 12582912.0  # 1.5 · 2**23: x + MAGIC·step rounds x half to even to a multiple of step


def _round_with_magic(x: jax.Array, magic: jax.Array) -> jax.Array:
    """x rounded half to even to a multiple of ``step``, given ``magic = 1.5·2**23·step`` (``step`` a power
    of two, 0 ≤ x < 2**22·step).

    One float add and one float subtract instead of a float→int→float round trip (two
    conversions). Callers fold 1.5·2**23 into the constant that already
    scales their step (one multiply per element fewer). The magic depends on the data,
    so XLA does not fold ``(x + m) − m`` back to x, as it does for a constant magic
    (seen with jax 0.11.2 on the CPU); the bit-exact tests against ml_dtypes would
    catch it if it ever did.
    """
    return (x + magic) - magic


def e4m3_round(x: jax.Array, *, assume_finite: bool = False) -> jax.Array:
    """Round non-negative float32 to the nearest e4m3fn value (ties to even), saturating finite values at 448.

    NaN and +inf give NaN (e4m3fn's only non-finite value). ``assume_finite=True`` (the caller guarantees
    finite input, e.g. softmax probabilities) skips that handling: the same values for
    finite x, and no ``is_finite``, which Pallas Mosaic GPU (jax 0.11.2) cannot lower.
    The grid step is 2**(e−3) for x in [2**e, 2**(e+1)), e ≥ −6, and 2**−9 below 2**−6
    (e4m3's subnormals); x is first clamped to 512, which still rounds to ≥ 448.
    """
    x = x.astype(jnp.float32)
    clamped = jnp.minimum(x, 512.0)
    magic = jnp.maximum(_exponent_floor(clamped), _E4M3_MIN_NORMAL) * (0.125 * _MAGIC)  # step 2**(e−3)
    out = jnp.minimum(_round_with_magic(clamped, magic), E4M3_MAX)
    if assume_finite:
        return out
    return jnp.where(x <= _FLOAT32_MAX, out, jnp.nan)  # NaN and +inf


def e2m1_round(y: jax.Array) -> jax.Array:
    """Round |values| (non-negative float32) to the e2m1 grid, ties to even, saturating at 6.

    The grid step is 0.5 below 2, 1 below 4 and 2 up to 6, i.e. max(2**floor(log2 y), 1)/2:
    a bit mask, a max, one multiply and the magic-number rounding (:func:`_round_with_magic`),
    all full-rate float/int instructions on the GPU. NaN stays NaN.
    """
    y = jnp.minimum(y, E2M1_MAX)
    return _round_with_magic(y, jnp.maximum(_exponent_floor(y), 1.0) * (0.5 * _MAGIC))


def e2m1_code(signed_value: jax.Array) -> jax.Array:
    """4-bit code (int32 0..15: sign bit 8, magnitude index 0..7) of an e2m1 grid value."""
    r = jnp.abs(signed_value)
    idx = jnp.where(r < 2.0, 2.0 * r, jnp.where(r < 4.0, r + 2.0, 0.5 * r + 4.0)).astype(jnp.int32)
    return jnp.where(signed_value < 0.0, idx | 8, idx)


E2M1_F16_BIAS = 2.0**14  # e2m1_decode_f16 returns value / 2**14


def e2m1_decode_f16(code: jax.Array) -> jax.Array:
    """The in-kernel e2m1 decode: 4-bit codes (int32 or uint8 0..15) → float16 ``value · 2**-14``.

    Pure bit placement, no gather and no table: the code's sign goes to bit 15,
    its 2 exponent bits and 1 mantissa bit to fp16 bits 11..9. fp16's subnormal
    range reproduces e2m1's subnormal 0.5 exactly, so the result is the value
    times 2**-14 (fold :data:`E2M1_F16_BIAS` into the group scale). Every FP4
    kernel decodes through this function.
    """
    c = code.astype(jnp.int32)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16)


def e2m1_decode(code: jax.Array) -> jax.Array:
    """float32 value of 4-bit codes (int32 or uint8 0..15), without a gather."""
    return e2m1_decode_f16(code).astype(jnp.float32) * E2M1_F16_BIAS


E4M3_F16_BIAS = 2.0**8  # e4m3_decode_f16 returns value / 2**8


def e4m3_decode_f16(bits: jax.Array) -> jax.Array:
    """The in-kernel e4m3 decode: finite e4m3fn bit patterns (uint8 or int32) → float16 ``value · 2**-8``.

    Bit placement only, as :func:`e2m1_decode_f16`: the sign to bit 15, the 4 exponent and 3 mantissa
    bits to fp16 bits 13..7. fp16's exponent bias (15) is e4m3's (7) plus 8, and fp16's subnormals
    reproduce e4m3's (step 2**-9 · 2**-8) exactly. The NaN patterns (0x7F, 0xFF: the scale of a group
    that held NaN or inf) decode to NaN.
    """
    b = bits.astype(jnp.int32)
    placed = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    placed = jnp.where((b & 0x7F) == 0x7F, 0x7E00, placed)  # fp16 NaN
    return jax.lax.bitcast_convert_type(placed.astype(jnp.int16), jnp.float16)


def repeat_groups(x: jax.Array, axis: int) -> jax.Array:
    """Each element of a 2-D tile ``x`` repeated :data:`GROUP` times along ``axis`` (0 or 1), by a broadcast
    and a reshape: the per-element view of per-group scales, written with ops Triton lowers."""
    r, c = x.shape
    if axis == 1:
        return jnp.broadcast_to(x[:, :, None], (r, c, GROUP)).reshape(r, c * GROUP)
    return jnp.broadcast_to(x[:, None, :], (r, GROUP, c)).reshape(r * GROUP, c)


def scale_tile_f16(values: jax.Array, scale_bits: jax.Array, *, axis: int) -> jax.Array:
    """The in-kernel NVFP4 dequantization of a decoded 2-D tile: float16 ``e2m1 · scale · 2**-14``, one fp16
    multiply a value.

    Args:
      values: float16 (rows, cols) ``e2m1 · 2**-14`` (:func:`e2m1_decode_f16`, or a backend's packed decode
        that gives the same bits, ``pallas_kernels._triton.e2m1_unpack_f16``).
      scale_bits: e4m3fn bit patterns (uint8/int32) of the group scales: (rows, cols/16) for groups along
        ``axis=1``, (rows/16, cols) for groups along ``axis=0``.
      axis: the axis the groups of 16 run along.
    Returns:
      float16 (rows, cols), exact: the value (two significant bits) times the true scale (four, from
      :func:`e4m3_decode_f16` · 2**8) has at most six significant bits and no bit below 2**-24, fp16's
      smallest subnormal step. Fold :data:`E2M1_F16_BIAS` into the other operand's scale.
    """
    scales = e4m3_decode_f16(scale_bits) * jnp.float16(E4M3_F16_BIAS)
    return values * repeat_groups(scales, axis)


#: bits of a cache byte (:func:`pack_halves`) that hold its first element (a) and its second (b)
HALF_BITS = (0x8E, 0x71)


def pack_pair(a: jax.Array, b: jax.Array) -> jax.Array:
    """Two 4-bit e2m1 codes → one cache byte: a's sign at bit 7 and magnitude at bits 3..1, b's magnitude at
    bits 6..4 and sign at bit 0 (int32, a's and b's shape).

    Why this order: a kernel places a byte in the high byte of a 16-bit lane, where a's bits already sit where a
    float16 ``value · 2**-14`` wants them (:func:`e2m1_decode_f16`: sign at 15, magnitude at 11..9), so one mask
    decodes a, and one shift each way decodes b (``pallas_kernels._triton.e2m1_unpack_f16``).
    """
    a, b = a.astype(jnp.int32), b.astype(jnp.int32)
    return ((a & 8) << 4) | ((a & 7) << 1) | ((b & 7) << 4) | ((b & 8) >> 3)


def unpack_pair(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`pack_pair`: cache bytes → (a codes, b codes), int32."""
    c = packed.astype(jnp.int32)
    return ((c >> 4) & 8) | ((c >> 1) & 7), ((c & 1) << 3) | ((c >> 4) & 7)


def pack_halves(codes: jax.Array) -> jax.Array:
    """4-bit codes (..., n) → uint8 (..., n/2): byte i holds element i and element i + n/2 (:func:`pack_pair`).

    The storage of :class:`lowbit_jax.ThriftKVCache`: unpacking a row gives its two contiguous halves
    (:func:`unpack_pair`), so a kernel contracts each half with a contiguous slice of the other operand
    (Triton can neither interleave nor slice a register tile). Same bytes per value as :func:`quantize`'s
    pairwise packing.
    """
    n = codes.shape[-1]
    if n % 2:
        raise ValueError(f"pack_halves needs an even last axis, got {codes.shape}")
    return pack_pair(codes[..., : n // 2], codes[..., n // 2:]).astype(jnp.uint8)


def unpack_halves(packed: jax.Array) -> jax.Array:
    """Inverse of :func:`pack_halves`: uint8 (..., n/2) → int32 codes (..., n)."""
    return jnp.concatenate(unpack_pair(packed), axis=-1)


def encode_last(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """φ along the last axis (a multiple of 16): (int32 codes (..., n), float32 e4m3 scales (..., n/16)).

    The same rounding as :func:`quantize` (it is :func:`quantize_groups`), with the codes left unpacked.
    """
    g = x.reshape(x.shape[:-1] + (x.shape[-1] // GROUP, GROUP))
    values, sf = quantize_groups(g)
    return e2m1_code(values).reshape(x.shape), sf[..., 0]


def e2m1_unpack(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`quantize`'s pairwise packing, bytes (..., n/2) → (codes of the even elements, codes of the odd
    elements), int32 (the low and high nibbles)."""
    c = packed.astype(jnp.int32)
    return c & 15, (c >> 4) & 15


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """Packed NVFP4 tensor (a pytree).

    Attributes:
      codes: uint8 (..., n // 2): the quantized axis moved last, two codes a byte.
      scales: float8_e4m3fn (..., n // 16): one scale per group of 16.
      axis: the original axis that was quantized (static).
      dtype: the original dtype (static), which :func:`dequantize` returns.
    """

    codes: jax.Array
    scales: jax.Array
    axis: int = dataclasses.field(metadata=dict(static=True))
    dtype: str = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        moved = self.codes.shape[:-1] + (2 * self.codes.shape[-1],)
        return tuple(np.moveaxis(np.empty(moved, dtype=np.bool_), -1, self.axis).shape)


def _groups(x: jax.Array, axis: int) -> tuple[jax.Array, int]:
    axis = axis % x.ndim
    if x.shape[axis] % GROUP:
        raise ValueError(f"NVFP4 needs the quantized axis to be a multiple of {GROUP}, got size {x.shape[axis]} "
                         f"on axis {axis}")
    moved = jnp.moveaxis(x, axis, -1)
    return moved.reshape(moved.shape[:-1] + (moved.shape[-1] // GROUP, GROUP)), axis


def quantize_groups(x: jax.Array, *, nonnegative: bool = False) -> tuple[jax.Array, jax.Array]:
    """φ on groups of 16 along the last axis of ``x`` (..., G, 16).

    Args:
      x: float (..., G, 16).
      nonnegative: the caller guarantees ``x >= 0`` (probabilities): the same result
        without the absolute values and the sign restore (fewer ops in a kernel).
    Returns:
      (signed e2m1 grid values float32 (..., G, 16), e4m3 scales float32 (..., G, 1)).
    """
    xf = x.astype(jnp.float32)
    mag_in = xf if nonnegative else jnp.abs(xf)
    # NaN counted as +inf, whichever NaN rule the backend's max follows: a non-finite group gets a NaN scale
    sf = group_scale(jnp.max(jnp.where(jnp.isnan(mag_in), jnp.inf, mag_in), axis=-1, keepdims=True))
    mag = e2m1_round(mag_in * (1.0 / sf))  # one reciprocal per group, as NVFP4 encoders do
    return (mag if nonnegative else jnp.where(xf < 0.0, -mag, mag)), sf


_INV6 = float(np.float32(1.0 / 6.0))


def _sixth(amax: jax.Array) -> jax.Array:
    """amax / 6 for finite non-negative float32, close enough that its e4m3 rounding is that of the exact
    quotient (the the spec's ``e4m3(amax / 6)``), computed alike by every backend.

    Why not ``amax / 6``: XLA rewrites a division by a constant into a multiply by fl(1/6) (jax 0.11.2,
    CPU and GPU), and a Pallas Mosaic GPU kernel's ``amax / 6`` gave the same values on the H200: 15
    float32 patterns of amax (0.11132812·2**k among them) round to the other e4m3 neighbour.
    Here: q0 = amax·fl(1/6) is within 1.5 ulp of x = amax/6; r = amax − 6·q0 is exact (4·q0 and 2·q0
    by exponent bumps of q0's bits, then two Sterbenz subtractions: no product a compiler could fuse);
    q0 + r·fl(1/6) is within ½ ulp + 2**-23 ulp of x, fused multiply-add or not (q0 enters the sum
    through an integer OR with the sign of amax, so no compiler can fuse q0's own product into it). An
    e4m3 rounding point (≤ 5 significant bits) is either x itself — then x is a float32 and the sum
    rounds to it — or at least ⅔ ulp(x) away, since amax − 6·point is a multiple of ulp(amax) ≥ 4 ulp(x);
    so the sum rounds as x does. For amax below 2**-123 (q0 subnormal) the bumps are wrong but the
    result stays below 2**-100 (e4m3 0, possibly −0). Checked on every finite non-negative float32
    against numpy's division: as XLA compiles it on the CPU and on the H200, and inside a Pallas-Triton
    and a Pallas Mosaic GPU kernel there (``benchmarks/nvfp4_scale_check.py``); tests/
    test_nvfp4_format.py samples it. Cost in the Mosaic Attn-QAT kernels against the division: fwd+bwd
    +1% at B4 H32 S4096 D128, level at D64.
    """
    q0 = amax * _INV6
    bits = jax.lax.bitcast_convert_type(q0, jnp.int32)
    q4 = jax.lax.bitcast_convert_type(bits + (2 << 23), jnp.float32)
    q2 = jax.lax.bitcast_convert_type(bits + (1 << 23), jnp.float32)
    r = (amax - q4) - q2
    sign = jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(amax, jnp.int32), jnp.int32(31))  # 0 for amax ≥ 0
    return jax.lax.bitcast_convert_type(bits | sign, jnp.float32) + r * _INV6


def group_scale(amax: jax.Array, *, assume_finite: bool = False) -> jax.Array:
    """The e4m3 group scale ``sf = e4m3(amax / 6)``, 1 for all-zero groups (float32, amax's shape).

    The quotient is :func:`_sixth` (no division, exact wherever it is compiled); ``assume_finite=False``
    keeps inf and NaN as they are for :func:`e4m3_round`'s non-finite rules (``assume_finite=True``: no
    ``is_finite``, which Pallas Mosaic GPU cannot lower)."""
    sixth = _sixth(amax) if assume_finite else jnp.where(jnp.isfinite(amax), _sixth(amax), amax)
    sf = e4m3_round(sixth, assume_finite=assume_finite)
    return jnp.where(sf == 0.0, 1.0, sf)


#: f(float32) → float32 rounded to e4m3 as :func:`e4m3_round` does (a kernel's hardware conversion)
ToE4m3 = Callable[[jax.Array], jax.Array]


def group_scale_16bit(amax: jax.Array, *, to_e4m3: ToE4m3 | None = None) -> jax.Array:
    """:func:`group_scale` of group maxima that are bfloat16 or float16 values (any float dtype holding them), by one
    multiply: amax·fl(1/6) rounds to e4m3 as the exact quotient amax/6 does, so the result equals
    ``group_scale(amax, assume_finite=True)`` (every finite non-negative bf16 and fp16 amax:
    tests/test_nvfp4_format.py).

    Why: fl(1/6) = (1/6)(1 + 2**-25), so for x = amax/6 in [2**e, 2**(e+1)) the product is within x·2**-25 <
    ½ ulp(x) of x before its rounding. Where x is an e4m3 rounding point (≤ 5 significant bits: amax = 6x has ≤ 7, a
    16-bit value) it rounds to x itself; any other x is at least ulp16(amax)/6 (≥ 2**-11·x) from every rounding
    point, since amax − 6·point is then a non-zero multiple of amax's 16-bit ulp. :func:`_sixth` (four operations
    more) is needed only for float32 amax.

    Args:
      amax: non-negative finite group maxima holding 16-bit values, any shape.
      to_e4m3: the rounding to e4m3 (a kernel's conversion instruction); None: :func:`e4m3_round`.
    Returns:
      float32 sf, amax's shape (1 for all-zero groups).
    """
    sixth = amax.astype(jnp.float32) * jnp.float32(_INV6)
    sf = (to_e4m3 or functools.partial(e4m3_round, assume_finite=True))(sixth)
    return jnp.where(sf == 0.0, 1.0, sf)


def fake_quant_parts(x: jax.Array, amax: jax.Array, *, nonnegative: bool = False, assume_finite: bool = False,
                     times: jax.Array | None = None,
                     broadcast: Callable[[jax.Array], jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """φ(x) element-wise as its two factors, given the amax of each element's group: (e2m1 values with x's
    sign, the group scale sf), both float32 of x's shape; φ⁻¹(φ(x)) = values · sf exactly (both factors and
    their product are exact in float32, bf16 and fp16). The one element-wise float32 fake quantizer behind
    :func:`fake_quant_probabilities` and the Mosaic GPU kernels, whose group maxima
    come from their own register layout (``pallas_kernels.lane_groups``).

    Args:
      x: float, any shape.
      amax: the group amax of every element (x's shape), or of every group if ``broadcast`` maps it to x's
        shape (the scale and its reciprocal are then computed once per group, then broadcast).
      nonnegative, assume_finite: as in :func:`quantize_groups` and :func:`e4m3_round`.
      times: a factor of amax's shape (constant along each group, e.g. a row's 1/l): the second factor is
        then sf · times, the product taken per group (before ``broadcast``).
    """
    xf = x.astype(jnp.float32)
    mag_in = xf if nonnegative else jnp.abs(xf)
    sf = group_scale(amax, assume_finite=assume_finite)
    inv = 1.0 / sf
    if times is not None:
        sf = sf * times
    if broadcast is not None:
        sf, inv = broadcast(sf), broadcast(inv)
    mag = e2m1_round(mag_in * inv)
    return (mag if nonnegative else jnp.where(xf < 0.0, -mag, mag)), sf


def round_to_bf16(x: jax.Array) -> jax.Array:
    """float32 x rounded to nearest even bfloat16 values, kept float32 (subnormals kept, as the GPU's conversion).

    ``lax.reduce_precision``: an explicit op that XLA never drops, unlike a float32 → bf16 → float32 convert
    pair, which XLA removes where it allows excess precision (its GPU default)."""
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


#: ``fma(a, k, c)`` for :func:`e2m1_round_16bit`: a·k + c with one rounding to a's 16-bit dtype (k a Python float)
Fma = Callable[[jax.Array, float, jax.Array], jax.Array]


def e2m1_round_16bit(y: jax.Array, *, fma: Fma | None = None) -> jax.Array:
    """:func:`e2m1_round` in the 16-bit arithmetic of y's dtype (bfloat16 or float16; non-negative, finite).

    The magic-number rounding (:func:`_round_with_magic`) with the 16-bit format's own magic
    (1.5·2**m·step, m its mantissa bits; y ≤ 6 < 2**(m−1)·step): every operation is exact or rounds
    as the float32 one would, so the result equals ``e2m1_round(y.astype(float32))``. The magic is
    2**(m−1) times h = 1.5·2**floor(log2 max(y, 1)), which one bit operation makes from max(y, 1)'s bits
    (its exponent, and the mantissa's top bit), so that y + magic and its − magic are each one
    ``fma(h, ±2**(m−1), ·)``: with a kernel's packed fma five packed instructions per two elements on the GPU
    (``min``, ``max``, an integer AND-OR, two ``fma.rn``.bf16x2), one fewer than ptxas makes of ``a * k + c``.

    Args:
      y: bfloat16 or float16, any shape.
      fma: a·k + c rounded once (a kernel's packed ``fma``); None: ``a * k + c``, equal here (a·k is exact).
    """
    if jnp.dtype(y.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(f"e2m1_round_16bit needs bfloat16 or float16, got {y.dtype}")
    mantissa_bits = jnp.finfo(y.dtype).nmant
    fma = fma or (lambda a, k, c: a * jnp.asarray(k, a.dtype) + c)
    y = jnp.minimum(y, jnp.asarray(E2M1_MAX, y.dtype))
    exponent_mask = 0x7FFF & ~((1 << mantissa_bits) - 1)
    # 1.5·2**floor(log2 max(y, 1)): the exponent kept, the mantissa's top bit set
    i16 = jax.lax.bitcast_convert_type(jnp.maximum(y, jnp.asarray(1.0, y.dtype)), jnp.int16)
    h = jax.lax.bitcast_convert_type((i16 & jnp.int16(exponent_mask)) | jnp.int16(1 << (mantissa_bits - 1)), y.dtype)
    k = float(2 ** (mantissa_bits - 1))
    return fma(h, -k, fma(h, k, y))


def fake_quant_bf16(h: jax.Array, amax: jax.Array, *, times: jax.Array | None = None,
                    fma: Fma | None = None, to_e4m3: ToE4m3 | None = None,
                    reciprocal: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """FQ of non-negative finite bfloat16 h in bfloat16 arithmetic (the Attn-QAT kernels' P̃ for bf16 operands).

    sf = e4m3(amax/6) in float32 (:func:`group_scale_16bit`: amax holds bf16 values); y = bf16(h · bf16(1/sf));
    P̃ = bf16(e2m1(y) · bf16(sf · times)). In a GPU kernel the element-wise part is one packed instruction per two
    elements for each step (about half the float32 quantizer's instructions); :func:`fake_quant_bf16_emulated` is
    the same function in float32 arithmetic for the references. Against float32 arithmetic
    (:func:`fake_quant_parts`) only inputs within ~2**-8 relative of an e2m1 rounding midpoint can round
    to the other neighbour, and the result's scale is rounded to bf16 when ``times`` is given.

    Args:
      h: bfloat16, any shape; amax: float32 or bfloat16 group maxima of h (h's shape, or broadcastable to it).
      times: float32 factor constant along each group (a row's 1/l), amax's shape; None: 1.
      fma: as in :func:`e2m1_round_16bit`.
      to_e4m3: as in :func:`group_scale_16bit` (amax holds bf16 values: the maxima of h).
      reciprocal: float32 1/sf to within 2 ulp (a kernel's approximate reciprocal); None: ``1 / sf``. The same
        bf16(1/sf) for every e4m3 sf: no such reciprocal is within 2 ulp of a bf16 rounding point
        (tests/test_nvfp4_format.py).
    Returns:
      bfloat16 of h's shape.
    """
    if jnp.dtype(h.dtype) != jnp.dtype(jnp.bfloat16):
        raise TypeError(f"fake_quant_bf16 needs bfloat16 h, got {h.dtype}")
    sf = group_scale_16bit(amax, to_e4m3=to_e4m3)
    inv = (reciprocal(sf) if reciprocal is not None else 1.0 / sf).astype(jnp.bfloat16)
    scale = (sf if times is None else sf * times).astype(jnp.bfloat16)
    return e2m1_round_16bit(h * inv, fma=fma) * scale


def fake_quant_bf16_emulated(x: jax.Array, amax: jax.Array, *, times: jax.Array | None = None,
                             broadcast: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """:func:`fake_quant_bf16` in float32 arithmetic, each bfloat16 rounding made explicit (:func:`round_to_bf16`):
    the references' twin of the kernels' native bf16 quantizer, equal to it bit for bit.

    Args:
      x: float32 holding bfloat16 values (:func:`round_to_bf16` of P); amax: their group maxima (x's shape, or
        one per group with ``broadcast``), bfloat16 values, so the scale is :func:`group_scale_16bit`'s as the
        kernels' is.
      times: as in :func:`fake_quant_bf16` (x's shape, or per group with ``broadcast``).
    Returns:
      float32 of x's shape, bfloat16 values.
    """
    sf = group_scale_16bit(amax)
    inv = round_to_bf16(1.0 / sf)
    scale = sf if times is None else round_to_bf16(sf * times)
    if broadcast is not None:
        inv, scale = broadcast(inv), broadcast(scale)
    return round_to_bf16(e2m1_round(round_to_bf16(x * inv)) * scale)


def fake_quant_probabilities(p: jax.Array, dtype, *, times: jax.Array | None = None,
                             emulated: bool = True) -> jax.Array:
    """Attn-QAT's P̃: FQ of probabilities in groups of 16 along the last axis, as every Attn-QAT kernel and
    reference computes it for 16-bit operands of ``dtype``.

    bfloat16: P is rounded to bf16 and quantized in bf16 arithmetic (:func:`fake_quant_bf16`; group amax of
    the rounded values), about half the float32 quantizer's instructions on the GPU. Other dtypes: the
    float32 quantizer (:func:`fake_quant_parts`). With ``times`` the result is e2m1 · (sf · times), the scale
    product taken once per group (rounded to bf16 in the bf16 case).

    Args:
      p: float32 (..., n), non-negative and finite, n a multiple of 16.
      dtype: the attention's operand dtype (bfloat16; float16 or float32 take the float32 quantizer).
      times: float32 (..., 1) (a row's 1/l) or None.
      emulated: bf16 arithmetic emulated in float32 with explicit roundings (:func:`fake_quant_bf16_emulated`,
        for the XLA references) or run natively (:func:`fake_quant_bf16`, inside kernels); equal bit for bit.
    Returns:
      float32 (..., n).
    """
    g, _ = _groups(p.astype(jnp.float32), -1)  # (..., n/16, 16); per-group values broadcast as (..., n/16, 1)
    t = None if times is None else times.astype(jnp.float32)[..., None]  # (..., 1, 1)
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        if emulated:
            h = round_to_bf16(g)
            out = fake_quant_bf16_emulated(h, jnp.max(h, axis=-1, keepdims=True), times=t)
        else:
            h = g.astype(jnp.bfloat16)
            out = fake_quant_bf16(h, jnp.max(h, axis=-1, keepdims=True), times=t).astype(jnp.float32)
    else:
        values, scale = fake_quant_parts(g, jnp.max(g, axis=-1, keepdims=True), nonnegative=True,
                                         assume_finite=True, times=t)
        out = values * scale
    return out.reshape(p.shape)


def fake_quant_last(x: jax.Array, *, nonnegative: bool = False) -> jax.Array:
    """φ⁻¹(φ(x)) along the last axis (a multiple of 16), as float32; no custom gradient.

    Works on whole arrays and on kernel tiles alike (a reshape to
    (..., n/16, 16), a group max, element-wise rounding): the one fake quantizer
    that the Attn-QAT kernels and their reference share. ``nonnegative=True``
    (for P) skips the sign handling; the values are the same for x >= 0.
    """
    g = x.reshape(x.shape[:-1] + (x.shape[-1] // GROUP, GROUP))
    values, sf = quantize_groups(g, nonnegative=nonnegative)
    return (values * sf).reshape(x.shape)


def quantize(x: jax.Array, axis: int = -1) -> NVFP4Tensor:
    """NVFP4-quantize ``x`` in groups of 16 along ``axis``.

    Args:
      x: float array; ``x.shape[axis]`` a multiple of 16.
      axis: the reduction axis of the product the tensor feeds.
    Returns:
      :class:`NVFP4Tensor`.
    """
    _, axis = _groups(x, axis)  # validates the axis length
    codes, sf = encode_last(jnp.moveaxis(x, axis, -1))
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(jnp.uint8)
    return NVFP4Tensor(packed, sf.astype(jnp.float8_e4m3fn), axis, jnp.dtype(x.dtype).name)


def dequantize(t: NVFP4Tensor) -> jax.Array:
    """Back to ``t.dtype`` with the original shape."""
    codes = jnp.stack(e2m1_unpack(t.codes), axis=-1).reshape(t.codes.shape[:-1] + (-1,))
    values = e2m1_decode(codes).reshape(codes.shape[:-1] + (-1, GROUP))
    out = (values * t.scales.astype(jnp.float32)[..., None]).reshape(codes.shape)
    return jnp.moveaxis(out, -1, t.axis).astype(t.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fake_quant(x: jax.Array, axis: int) -> jax.Array:
    _, ax = _groups(x, axis)
    out = fake_quant_last(jnp.moveaxis(x, ax, -1))
    return jnp.moveaxis(out, -1, ax).astype(x.dtype)


def _fake_quant_fwd(x, axis):
    return _fake_quant(x, axis), None


def _fake_quant_bwd(axis, _, g):
    del axis
    return (g,)


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def fake_quant(x: jax.Array, axis: int = -1) -> jax.Array:
    """``dequantize(quantize(x, axis))`` in x's dtype, with a straight-through gradient."""
    return _fake_quant(x, axis)
