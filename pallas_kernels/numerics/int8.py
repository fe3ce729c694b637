"""INT8 quantizer ψ (symmetric) and the integer/float tricks the kernels rely on.

Every function here is plain ``jax.numpy`` written only with operations the
Pallas-Triton lowering accepts (no ``round``, no gather, no sort), so the very
same function runs inside a Pallas kernel on a tile and in the pure-JAX
reference on a whole array. Kernels and references both import these; neither
re-derives them.

Conventions (docs/spec.md, "Quantizers"):

* scale ``s = amax|x| / 127`` over the group (``amax == 0`` gives ``s = 1``); a group holding NaN or
  ±inf gets a non-finite scale (:func:`magnitude`, :func:`scale_from_amax`), so every value dequantized
  with it is non-finite too: bad input stays visible instead of being rounded away;
* codes ``= round_half_away_from_zero(x / s)`` clipped to ``[-127, 127]``;
* the reciprocal ``127 / amax`` is computed once per group and multiplied, so a
  kernel never divides per element.

Probabilities P (non-negative, at most 1 by construction) are quantized with the
"magic number" rounding: adding ``1.5 * 2**23`` to a float in ``[0, 2**22)``
leaves the round-half-to-even integer in the low mantissa bits. This is one FFMA
per element instead of a floor and two conversions.
SageBwd's dS codes round the same way (:func:`quantize_half_even`; negative values
leave their two's complement code in the low byte): a deviation from the spec's half away
from zero that shows only on exact ties, chosen for speed and used alike by the
reference and every kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

QMAX = 127.0
#: 1.5 * 2**23: x + MAGIC has x's round-half-to-even integer in its low bits.
MAGIC = 12582912.0
#: The int32 bit pattern of MAGIC (``bitcast(MAGIC, int32)``).
MAGIC_BITS = 0x4B400000


def magnitude(x: jax.Array) -> jax.Array:
    """``|x|`` with NaN mapped to +inf, the input of a group maximum: the maximum is then +inf exactly when the
    group holds a non-finite value, whichever NaN rule the backend's ``max`` follows (Triton's drops NaN)."""
    a = jnp.abs(x)
    return jnp.where(jnp.isnan(a), jnp.inf, a)


def scale_from_amax(amax: jax.Array) -> jax.Array:
    """Dequantization scale ``amax / 127``, with ``amax == 0`` mapped to 1 and a non-finite amax kept
    non-finite (so the group's dequantized values are too).

    Args:
      amax: any shape, float32, non-negative or NaN.
    Returns:
      float32 array of amax's shape.
    """
    amax = amax.astype(jnp.float32)
    return jnp.where(amax == 0.0, 1.0, amax * (1.0 / QMAX))


def _half_away(y: jax.Array) -> jax.Array:
    """``±0.5`` with the sign bit of ``y`` (``copysign(0.5, y)`` as one AND/OR on the bits)."""
    bits = jax.lax.bitcast_convert_type(y, jnp.uint32)
    return jax.lax.bitcast_convert_type((bits & jnp.uint32(0x80000000)) | jnp.uint32(0x3F000000), jnp.float32)


def encode_with_scale(x: jax.Array, scale: jax.Array, *,
                      broadcast: Callable[[jax.Array], jax.Array] | None = None, clip: bool = True) -> jax.Array:
    """INT8 codes of ``x`` given a broadcastable dequantization ``scale``.

    Rounding is the spec's ``floor(|y| + 0.5)·sign(y)`` (round half away from zero, the
    sum in float32), computed as ``trunc(y + copysign(0.5, y))``: the float→int
    conversion truncates toward zero, so no ``floor``/``round`` instruction is needed
    (Triton has no ``round``; Mosaic GPU's ``lax.round`` expands to several instructions).
    (The fused SageBwd kernel measured 6% faster than with ``lax.round``, the Triton dK/dV
    kernel 4% faster than with ``floor``.) The two forms are equal for every float, since ``y − 0.5`` rounds exactly as
    ``−(|y| + 0.5)``.

    Args:
      x: float array (any shape).
      scale: float32, broadcastable to ``x``, positive.
      broadcast: maps the reciprocal of ``scale`` onto x's shape, for callers whose
        arrays do not broadcast implicitly (a per-row vector over a Mosaic GPU tile).
      clip: False only where ``scale`` is ``amax/127`` of x's own group (:func:`quantize`, the
        kernels' dS tiles): then ``|x / scale| ≤ 127`` up to a few ulps, ``|y| + 0.5 < 128``
        truncates to at most 127, and the clip (two instructions per element) changes nothing.
    Returns:
      int8 array of x's shape, ``clip(round_half_away(x / scale), -127, 127)``.
    """
    y = _divided(x, scale, broadcast)
    z = y + _half_away(y)
    # clip before the truncation: the same codes as clipping after (±127 are integers)
    return (jnp.clip(z, -QMAX, QMAX) if clip else z).astype(jnp.int8)


def quantize(x: jax.Array, axes: int | Sequence[int] = -1, *,
             broadcast: Callable[[jax.Array], jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """Symmetric INT8 quantization ψ with one scale per group.

    A group is all elements that share the indices outside ``axes``: ``axes=-1``
    on a (tokens, D) tile is per-token quantization, ``axes=(-2, -1)`` is one
    scale for the whole tile (per-block).

    Args:
      x: float array (bf16/fp16/fp32), any rank.
      axes: the reduction axes of one group.
      broadcast: as in :func:`encode_with_scale`, for arrays that do not broadcast implicitly
        (a Mosaic GPU tile); the scale then comes without the reduced ``axes``.
    Returns:
      ``(codes, scale)``: int8 codes of x's shape and the float32 dequantization
      scale with ``axes`` kept as size-1 dims (unless ``broadcast``), so ``codes * scale ≈ x``.
    """
    xf = x.astype(jnp.float32)
    scale = _group_scale(xf, axes, broadcast)
    return encode_with_scale(xf, scale, broadcast=broadcast, clip=False), scale


def _divided(x: jax.Array, scale: jax.Array, broadcast: Callable[[jax.Array], jax.Array] | None) -> jax.Array:
    """``x / scale`` in float32 as ``x · (1/scale)``: one reciprocal per group (the small scale array), one
    multiply per element; ``broadcast`` maps the reciprocal onto x's shape (see :func:`encode_with_scale`)."""
    inv = 1.0 / scale
    return x.astype(jnp.float32) * (inv if broadcast is None else broadcast(inv))


def _group_scale(xf: jax.Array, axes: int | Sequence[int],
                 broadcast: Callable[[jax.Array], jax.Array] | None) -> jax.Array:
    """``amax/127`` of each group of float32 ``xf`` (the elements sharing the indices outside ``axes``),
    with ``axes`` kept as size-1 dims unless ``broadcast`` (see :func:`quantize`)."""
    return scale_from_amax(jnp.max(magnitude(xf), axis=axes, keepdims=broadcast is None))


def reciprocal_or_zero(x: jax.Array) -> jax.Array:
    """``1 / x``, and 0 where ``x == 0`` (for non-negative x: empty rows, all-zero groups); NaN stays NaN."""
    zero = x == 0.0
    return jnp.where(zero, 0.0, 1.0 / jnp.where(zero, 1.0, x))


def dequantize(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """``codes * scale`` in float32 (scale broadcastable to codes)."""
    return codes.astype(jnp.float32) * scale


def int32_as_biased_float(i: jax.Array) -> jax.Array:
    """Reinterpret an int32 with ``|i| < 2**22`` as the float ``MAGIC + i`` (exact).

    One integer add instead of an int→float conversion (on Hopper the conversion measures
    no slower than this add and the float subtract that recovers i; the Triton forward
    keeps the biased form because it also feeds the row maximum).
    Differences of two such floats are exact integers,
    since all of them lie in ``[2**23, 2**24)``. An INT8·INT8 dot over up to 256
    terms stays below 2**22 in magnitude.
    """
    return jax.lax.bitcast_convert_type(i + MAGIC_BITS, jnp.float32)


def encode_unit_interval(e: jax.Array, *, truncating_convert: bool = False) -> jax.Array:
    """INT8 codes ``rne(127·e)`` of values ``e`` in ``[0, 1]`` (one FFMA each).

    Used for P̃ after dividing by its row maximum: the largest value of a row
    maps to 127 exactly.

    Args:
      e: float32 values in [0, 1].
      truncating_convert: the kernels' form: the magic-number FFMA, then the
        int32 → int8 conversion keeping the low byte (Triton's ``trunci``),
        which already is the rounded integer. Outside kernels leave it False:
        the same round-half-to-even through ``jnp.round`` (XLA on the GPU gave
        wrong codes from the bit form in SageBwd's reference).
    """
    return round_to_code(e * QMAX, truncating_convert=truncating_convert)


def round_to_code(y: jax.Array, *, truncating_convert: bool = False) -> jax.Array:
    """INT8 codes ``rne(y)`` of float32 ``y`` in ``[-127, 127]`` (see :func:`encode_unit_interval`; for negative
    ``y`` the magic number's low byte is the two's complement code)."""
    if not truncating_convert:
        return jnp.round(y).astype(jnp.int8)  # round half to even, as the magic number
    return jax.lax.bitcast_convert_type(y + MAGIC, jnp.int32).astype(jnp.int8)


def quantize_unit(p: jax.Array, axis: int, *, truncating_convert: bool = False,
                  broadcast: Callable[[jax.Array], jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """INT8 codes of non-negative ``p`` (probabilities), one scale per slice along ``axis``.

    The slice maximum maps to 127 (round half to even, one FFMA per element: 127 is folded
    into the slice's reciprocal, ``rne(p · (127/max))``); the dequantization scale is
    ``max / 127`` (1 for all-zero slices).

    Args:
      p: float32, non-negative.
      axis: the reduction axis of the product the codes feed.
      truncating_convert: see :func:`encode_unit_interval` (True only inside kernels).
      broadcast: as in :func:`encode_with_scale` (a Mosaic GPU tile); the scale then comes
        without ``axis``.
    Returns:
      ``(codes int8 of p's shape, scale float32 with axis kept as size 1 (unless ``broadcast``))``.
    """
    pmax = jnp.max(p, axis=axis, keepdims=broadcast is None)
    inv = QMAX * reciprocal_or_zero(pmax)
    codes = round_to_code(p * (inv if broadcast is None else broadcast(inv)), truncating_convert=truncating_convert)
    return codes, scale_from_amax(pmax)


def encode_half_even(x: jax.Array, scale: jax.Array, *, truncating_convert: bool = False,
                     broadcast: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """INT8 codes ``rne(x / scale)`` for a self-scaled group (``scale = amax/127`` of x's own group, so
    ``|x / scale| ≤ 127``): SageBwd's dS codes.

    Round half to even instead of the spec's half away from zero (a tie, x/scale exactly k + ½, is the only
    difference): in a kernel one FFMA (``x·(1/scale) + MAGIC``) and the byte pack, as P̂'s codes, instead
    of a multiply, a copysign, an add, two clamps and a float→int conversion per element.

    Args:
      x: float array; scale: float32, positive, broadcastable (or mapped by ``broadcast``, as in
        :func:`encode_with_scale`).
      truncating_convert: the kernels' magic-number form (see :func:`encode_unit_interval`).
    Returns:
      int8 array of x's shape.
    """
    return round_to_code(_divided(x, scale, broadcast), truncating_convert=truncating_convert)


def quantize_half_even(x: jax.Array, axes: int | Sequence[int] = -1, *, truncating_convert: bool = False,
                       broadcast: Callable[[jax.Array], jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """:func:`quantize` with the codes rounded half to even (:func:`encode_half_even`): SageBwd's dS.

    Args and returns as :func:`quantize`; ``truncating_convert`` as in :func:`encode_unit_interval`.
    """
    xf = x.astype(jnp.float32)
    scale = _group_scale(xf, axes, broadcast)
    return encode_half_even(xf, scale, truncating_convert=truncating_convert, broadcast=broadcast), scale
