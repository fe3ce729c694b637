"""NVFP4 φ: bit-exact against ml_dtypes' float4_e2m1fn / float8_e4m3fn oracles (on the host)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.numerics import nvfp4
from pallas_kernels import lane_groups


def oracle(x: np.ndarray) -> np.ndarray:
    """float64 reference of φ along the last axis, with ml_dtypes doing every rounding."""
    g = x.astype(np.float32).reshape(x.shape[:-1] + (-1, 16))
    amax = np.abs(g).max(-1, keepdims=True)
    # scales above e4m3's 448 saturate (ml_dtypes would give NaN): pallas_kernels.numerics.nvfp4's documented choice
    sf = np.minimum(amax / np.float32(6), 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    sf = np.where(sf == 0, np.float32(1), sf)
    q = (g * (np.float32(1) / sf)).astype(ml_dtypes.float4_e2m1fn)  # one reciprocal per group
    q = q.astype(np.float32)
    return (q * sf).reshape(x.shape)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0, 1e-5])
def test_matches_ml_dtypes_on_random_inputs(scale):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 64)) * scale * rng.uniform(0.1, 10, (8, 1))).astype(np.float32)
    ours = np.asarray(nvfp4.dequantize(nvfp4.quantize(jnp.asarray(x))))
    np.testing.assert_array_equal(ours, oracle(x))


def test_rounding_survives_jit():
    """XLA folds (x + C) - C under jit; the rounding must not depend on that expression."""
    x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 32)) * 3, jnp.float32)
    eager = nvfp4.dequantize(nvfp4.quantize(x))
    jitted = jax.jit(lambda x: nvfp4.dequantize(nvfp4.quantize(x)))(x)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager))
    np.testing.assert_array_equal(np.asarray(jitted), oracle(np.asarray(x)))


def _with_neighbours(x: np.ndarray) -> np.ndarray:
    """x and the float32 numbers just below and above each value (the sides of every tie)."""
    x = x.astype(np.float32)
    return np.concatenate([x, np.nextafter(x, np.float32(-1)), np.nextafter(x, np.float32(np.inf))]).clip(0)


@pytest.mark.parametrize("jit", [False, True])
def test_element_rounding_exhaustive_grid_and_ties(jit):
    """e2m1/e4m3 rounding equals ml_dtypes on a fine grid, on every tie and on both float32 neighbours of
    each tie, eagerly and under jit (the magic-number rounding must survive XLA's simplifier)."""
    wrap = jax.jit if jit else (lambda f: f)  # noqa: E731
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 7.0, 100.0])
    y = _with_neighbours(np.concatenate([np.arange(0, 7, 0.03125), ties]))
    ours = np.asarray(wrap(nvfp4.e2m1_round)(jnp.asarray(y)))
    np.testing.assert_array_equal(ours, np.minimum(y, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid) & (grid >= 0)])
    midpoints = (grid[:-1] + grid[1:]) / 2  # e4m3 ties (exact in float32)
    s = _with_neighbours(np.concatenate([np.geomspace(2.0**-12, 448, 5000), grid, midpoints,
                                         [0.0, 2.0**-9, 3 * 2.0**-10, 1.0625, 1.9375, 240.0]]))
    want = s.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(wrap(nvfp4.e4m3_round)(jnp.asarray(s))), want)
    big = np.array([448.0, 449.0, 463.9, 464.0, 500.0, 1e30], np.float32)  # finite: saturate at 448
    np.testing.assert_array_equal(np.asarray(wrap(nvfp4.e4m3_round)(jnp.asarray(big))), np.full(big.shape, 448.0))
    assert np.isnan(np.asarray(wrap(nvfp4.e4m3_round)(jnp.asarray([np.nan, np.inf], jnp.float32)))).all()
    assert np.isnan(np.asarray(wrap(nvfp4.e2m1_round)(jnp.asarray([np.nan], jnp.float32)))).all()


def test_codes_decode_and_pack_round_trip():
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    values = np.concatenate([grid, -grid[1:]])
    codes = np.asarray(nvfp4.e2m1_code(jnp.asarray(values)))
    np.testing.assert_array_equal(np.asarray(nvfp4.e2m1_decode(jnp.asarray(codes))), values)
    # ml_dtypes' bit patterns for the same values
    np.testing.assert_array_equal(codes, values.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 32, 48)), jnp.bfloat16)
    t = nvfp4.quantize(x, axis=1)
    assert t.codes.shape == (3, 48, 16) and t.codes.dtype == jnp.uint8
    assert t.scales.shape == (3, 48, 2) and t.scales.dtype == jnp.float8_e4m3fn
    assert t.shape == x.shape
    back = nvfp4.dequantize(t)
    assert back.shape == x.shape and back.dtype == x.dtype
    again = nvfp4.dequantize(nvfp4.quantize(back, axis=1))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(back))  # idempotent on its own grid
    bytes_per_value = (t.codes.size + t.scales.size) / x.size
    assert bytes_per_value == 0.5625


def test_zero_tiny_and_huge_groups():
    x = np.zeros((2, 16), np.float32)
    x[1] = 1e-30  # below e4m3's smallest subnormal scale: the group flushes to zero
    out = np.asarray(nvfp4.dequantize(nvfp4.quantize(jnp.asarray(x))))
    np.testing.assert_array_equal(out, 0.0)
    big = np.full((1, 16), 1e6, np.float32)
    big[0, 0] = 3e6
    out = np.asarray(nvfp4.dequantize(nvfp4.quantize(jnp.asarray(big))))
    assert out.max() == 6 * 448.0  # the scale saturates at e4m3's 448


def test_non_finite_input():
    x = np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32)
    x[0, 3] = np.nan
    x[1, 5] = np.inf
    x[2, 7] = -np.inf
    out = np.asarray(nvfp4.dequantize(nvfp4.quantize(jnp.asarray(x))))
    assert np.all(np.isnan(out))  # NaN and ±inf each make their group's scale NaN: the whole group shows it


def test_fake_quant_value_and_straight_through_gradient():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 32)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(nvfp4.fake_quant(x)), np.asarray(nvfp4.dequantize(nvfp4.quantize(x))))
    g = jax.grad(lambda x: jnp.sum(nvfp4.fake_quant(x, 1) * jnp.arange(32.0)))(x)
    np.testing.assert_array_equal(np.asarray(g), np.broadcast_to(np.arange(32.0), (4, 32)))
    assert jax.jit(nvfp4.fake_quant, static_argnums=1)(x, 1).shape == x.shape


def test_bad_axis_size():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(jnp.zeros((4, 24)))


def test_f16_bit_placement_decode_exhaustive():
    """The in-kernel decode: all 16 codes, bit placement into fp16 times 2**14 = ml_dtypes' value."""
    codes = np.arange(16, dtype=np.uint8)
    want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = np.asarray(nvfp4.e2m1_decode_f16(jnp.asarray(codes)), np.float32) * nvfp4.E2M1_F16_BIAS
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(nvfp4.e2m1_decode(jnp.asarray(codes))), want)


def test_unpack_even_odd_halves():
    x = jnp.asarray(np.random.default_rng(9).standard_normal((3, 32)), jnp.float32)
    t = nvfp4.quantize(x)
    even, odd = nvfp4.e2m1_unpack(t.codes)
    values, _ = nvfp4.quantize_groups(x.reshape(3, 2, 16))
    codes = np.asarray(nvfp4.e2m1_code(values)).reshape(3, 32)
    np.testing.assert_array_equal(np.asarray(even), codes[:, 0::2])
    np.testing.assert_array_equal(np.asarray(odd), codes[:, 1::2])


def test_cache_byte_pairs_round_trip():
    """Every pair of codes survives the cache's byte (``pack_pair``/``unpack_pair``), each element's bits lie in its
    ``HALF_BITS``, and ``pack_halves`` puts element i with element i + n/2."""
    a, b = (x.ravel() for x in np.meshgrid(np.arange(16), np.arange(16)))
    packed = np.asarray(nvfp4.pack_pair(jnp.asarray(a), jnp.asarray(b)))
    assert packed.min() >= 0 and packed.max() < 256 and len(np.unique(packed)) == 256
    got_a, got_b = (np.asarray(x) for x in nvfp4.unpack_pair(jnp.asarray(packed, jnp.uint8)))
    np.testing.assert_array_equal(got_a, a)
    np.testing.assert_array_equal(got_b, b)
    zero = jnp.zeros(16, jnp.int32)
    codes = jnp.arange(16)
    assert not np.any(np.asarray(nvfp4.pack_pair(codes, zero)) & ~nvfp4.HALF_BITS[0] & 0xFF)
    assert not np.any(np.asarray(nvfp4.pack_pair(zero, codes)) & ~nvfp4.HALF_BITS[1] & 0xFF)
    assert nvfp4.HALF_BITS[0] | nvfp4.HALF_BITS[1] == 0xFF and not nvfp4.HALF_BITS[0] & nvfp4.HALF_BITS[1]
    row = np.random.default_rng(3).integers(0, 16, (2, 64))
    halves = np.asarray(nvfp4.unpack_pair(nvfp4.pack_halves(jnp.asarray(row))))
    np.testing.assert_array_equal(halves[0], row[:, :32])
    np.testing.assert_array_equal(halves[1], row[:, 32:])
    np.testing.assert_array_equal(np.asarray(nvfp4.unpack_halves(nvfp4.pack_halves(jnp.asarray(row)))), row)


def test_fake_quant_last_matches_oracle_on_tiles():
    x = np.random.default_rng(4).standard_normal((2, 8, 48)).astype(np.float32) * 0.01
    np.testing.assert_array_equal(np.asarray(jax.jit(nvfp4.fake_quant_last)(jnp.asarray(x))), oracle(x))


def test_fake_quant_last_nonnegative_form_matches_oracle():
    """The sign-free form used for P: identical values on non-negative input (zeros, ties, tiny, saturating)."""
    rng = np.random.default_rng(5)
    p = np.exp(rng.standard_normal((4, 8, 64)) * 3).astype(np.float32) * 1e-3
    p[0, 0, :16] = 0.0  # an all-zero group
    p[1, 0, :16] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2, np.float32)  # ties on the grid
    p[2] = np.exp2(-rng.uniform(0, 30, (8, 64))).astype(np.float32)  # exp2(S - m) in (0, 1]
    got = np.asarray(jax.jit(functools.partial(nvfp4.fake_quant_last, nonnegative=True))(jnp.asarray(p)))
    np.testing.assert_array_equal(got, oracle(p))
    np.testing.assert_array_equal(got, np.asarray(nvfp4.fake_quant_last(jnp.asarray(p))))


def test_group_scale_rounds_the_exact_quotient():
    """sf = e4m3(amax / 6) of the correctly rounded quotient (numpy's division, ml_dtypes' rounding), with
    or without ``assume_finite``, eagerly and under jit. XLA turns ``amax / 6`` into a multiply by fl(1/6),
    which rounds 15 float32 patterns to the other e4m3 neighbour (0.11132812·2**k among them), so the
    quotient is nvfp4._sixth. A check of every finite non-negative float32 passed
    (benchmarks/nvfp4_scale_check.py, on the CPU and on the H200); here: random bit patterns, every e4m3
    value and rounding point times 6 with the float32 neighbours of each, P-like values in (0, 1], and zero."""
    rng = np.random.default_rng(7)
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid) & (grid >= 0)])
    points = np.concatenate([grid, (grid[:-1] + grid[1:]) / 2]) * 6  # amax whose sixth is a value or a tie
    amax = np.concatenate([
        rng.integers(0, 0x45280000, 1 << 20, dtype=np.uint32).view(np.float32),  # up to 2688 = 6·448
        _with_neighbours(points), np.exp2(-rng.uniform(0, 40, 1 << 16)).astype(np.float32),
        np.float32(0.11132812) * np.exp2(np.arange(-8, 12)).astype(np.float32), [0.0, 1.0]]).astype(np.float32)
    amax = amax[amax <= 2688.0]
    want = (amax / np.float32(6)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    want = np.where(want == 0, np.float32(1), want)
    for wrap in (lambda f: f, jax.jit):
        for assume_finite in (False, True):
            got = wrap(functools.partial(nvfp4.group_scale, assume_finite=assume_finite))(jnp.asarray(amax))
            np.testing.assert_array_equal(np.asarray(got), want)
    rel = jnp.abs(nvfp4._sixth(jnp.asarray(amax)) - amax / np.float32(6)) / np.maximum(amax / 6, 1e-30)
    assert float(jnp.max(rel)) < 2.0**-23


def _e4m3_values() -> np.ndarray:
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return np.unique(grid[np.isfinite(grid) & (grid > 0)])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_group_scale_of_16bit_maxima_by_one_multiply(dtype):
    """``group_scale_16bit`` (amax·fl(1/6), no ``_sixth``) equals ``group_scale`` on every finite non-negative
    bf16 and fp16 amax, with its own rounding and with the kernels' conversion to e4m3 (as interpreted); and a
    float32 amax that is not a 16-bit value can round the other way (why ``_sixth`` stays for those)."""
    bits = np.arange(0x8000, dtype=np.uint16)
    amax = bits.view(dtype)
    amax = amax[np.isfinite(amax.astype(np.float32))]
    want = nvfp4.group_scale(jnp.asarray(amax.astype(np.float32)), assume_finite=True)
    for to_e4m3 in (None, lambda x: lane_groups.e4m3_by_conversion(x, interpret=True)):
        for arg in (jnp.asarray(amax), jnp.asarray(amax.astype(np.float32))):
            got = jax.jit(functools.partial(nvfp4.group_scale_16bit, to_e4m3=to_e4m3))(arg)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    wide = np.float32(0.11132812) * np.exp2(np.arange(-8, 12)).astype(np.float32)  # _sixth's documented cases
    assert not np.array_equal(np.asarray(nvfp4.group_scale_16bit(jnp.asarray(wide))),
                              np.asarray(nvfp4.group_scale(jnp.asarray(wide), assume_finite=True)))


def test_e4m3_by_conversion_saturates_as_e4m3_round():
    """The kernels' e4m3 conversion (interpreted: XLA's, clamped) rounds as ``e4m3_round``: every e4m3 value and
    midpoint with its float32 neighbours, random values up to 2**20, and 464 (XLA's NaN without the clamp)."""
    grid = _e4m3_values()
    x = np.concatenate([_with_neighbours(np.concatenate([grid, (grid[:-1] + grid[1:]) / 2])),
                        np.random.default_rng(5).uniform(0, 2.0**20, 4096).astype(np.float32), [0.0, 464.0, 1e30]])
    x = jnp.asarray(x.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(lane_groups.e4m3_by_conversion(x, interpret=True)),
                                  np.asarray(nvfp4.e4m3_round(x, assume_finite=True)))


def test_signed_e4m3_rounding_in_arithmetic_is_the_cast():
    """``e4m3.rounded`` (the references' e4m3 codes, by float arithmetic: XLA on the GPU drops a float32 → float8 →
    float32 round trip) equals ml_dtypes' cast on every e4m3 value and midpoint of either sign with their float32
    neighbours below 464, and gives NaN for NaN and ±inf."""
    from pallas_kernels.numerics import e4m3

    grid = _e4m3_values()
    x = _with_neighbours(np.concatenate([grid, (grid[:-1] + grid[1:]) / 2])).astype(np.float32)
    x = np.concatenate([x, -x])
    x = x[np.abs(x) < 464]
    want = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(e4m3.rounded)(jnp.asarray(x))), want)
    assert np.isnan(np.asarray(e4m3.rounded(jnp.asarray([np.nan, np.inf, -np.inf], jnp.float32)))).all()


def test_bf16_reciprocal_of_every_e4m3_scale_is_safe_within_two_ulp():
    """bf16(1/sf) is the same for any float32 within 2 ulp of 1/sf, for every e4m3 sf (and sf = 1 of zero groups):
    so the kernels' ``rcp.approx.ftz.f32`` (at most 1 ulp off, PTX ISA) gives the references' bf16 reciprocal.
    A reciprocal off by 2**-9 relative (a bf16 rounding) would not be."""
    sf = np.append(_e4m3_values(), np.float32(1))
    exact = np.float32(1) / sf
    want = exact.astype(ml_dtypes.bfloat16)
    for direction in (np.float32(np.inf), np.float32(-np.inf)):
        near = exact
        for _ulp in range(2):
            near = np.nextafter(near, direction)
            np.testing.assert_array_equal(near.astype(ml_dtypes.bfloat16), want)
    off = (exact * np.float32(1 + 2.0**-9)).astype(ml_dtypes.bfloat16)
    assert (off != want).any()


#: XLA compiles 16-bit arithmetic as float32 with converts between the operations and, where it allows excess
#: precision (its default), drops float32 → bf16 → float32 pairs: a bf16 operation it runs can skip the rounding the
#: GPU's packed instruction makes (2.8% of elements one ulp off in the test below). Off for these compilations.
EXACT_16BIT = {"xla_allow_excess_precision": False}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_e2m1_rounding_in_16bit_arithmetic_is_exact(dtype):
    """``e2m1_round_16bit`` (the magic-number rounding in the 16-bit format's own arithmetic) equals the float32
    rounding on every non-negative finite 16-bit value up to 10, ties and saturation included."""
    top = 0x7C00 if dtype == jnp.float16 else 0x7F80
    y = jnp.asarray(np.arange(top, dtype=np.uint16).view(dtype))
    y = y[y <= 10]
    want = nvfp4.e2m1_round(y.astype(jnp.float32))
    got = jax.jit(nvfp4.e2m1_round_16bit, compiler_options=EXACT_16BIT)(y)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)

    def fused(a, k, c):  # a kernel's fma: a·k + c rounded once (in float32 exactly here, then to the 16-bit dtype)
        fused.calls += 1
        return (a.astype(jnp.float32) * k + c.astype(jnp.float32)).astype(a.dtype)

    fused.calls = 0
    got = jax.jit(functools.partial(nvfp4.e2m1_round_16bit, fma=fused), compiler_options=EXACT_16BIT)(y)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    assert fused.calls == 2  # y + magic and − magic
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        nvfp4.e2m1_round_16bit(y.astype(jnp.float32))


def _probability_groups(seed: int, groups: int = 4096) -> tuple[jax.Array, jax.Array]:
    """(groups, 16) non-negative probabilities over many decades (some groups all tiny or all zero) and a 1/l per
    group's row."""
    rng = np.random.default_rng(seed)
    p = np.exp2(rng.uniform(-30, 0, size=(groups, 16))) * (rng.uniform(size=(groups, 16)) > 0.1)
    p[::97] = 0.0
    p[1::89] *= 2.0**-100
    inv_l = rng.uniform(2.0**-17, 1.0, size=(groups, 1))
    return jnp.asarray(p, jnp.float32), jnp.asarray(inv_l, jnp.float32)


@pytest.mark.parametrize("with_times", [False, True])
def test_bf16_probability_quantizer_native_equals_emulated(with_times):
    """Attn-QAT's P̃ for bf16 operands: the kernels' native bf16 arithmetic (``fake_quant_bf16``, here compiled
    by XLA without excess precision) and the references' float32 emulation with explicit roundings are equal bit for bit, on
    every bf16 value in [0, 1] (in random groups) and on probabilities over many decades; and both are a real
    NVFP4 quantization: e2m1 · e4m3 values, differing from the float32 quantizer on few elements only."""
    bits = np.random.default_rng(3).permutation(np.arange(0x3F81, dtype=np.uint16))[: 0x3F80 // 16 * 16]
    every = jnp.asarray(bits.view(jnp.bfloat16).astype(np.float32)).reshape(-1, 16)
    for p, inv_l in ((every, _probability_groups(1, every.shape[0])[1]), _probability_groups(2)):
        times = inv_l if with_times else None
        native = jax.jit(functools.partial(nvfp4.fake_quant_probabilities, dtype=jnp.bfloat16, emulated=False),
                         compiler_options=EXACT_16BIT)(p, times=times)
        emulated = jax.jit(functools.partial(nvfp4.fake_quant_probabilities, dtype=jnp.bfloat16))(p, times=times)
        np.testing.assert_array_equal(native, emulated)
        plain = nvfp4.fake_quant_probabilities(p, jnp.bfloat16)  # e2m1 · sf, sf from bf16(P)'s group maxima
        h = nvfp4.round_to_bf16(p)
        sf = nvfp4.group_scale(jnp.max(h, axis=-1, keepdims=True), assume_finite=True)
        values = np.asarray(plain, np.float64) / np.asarray(sf, np.float64)
        assert np.isin(values, [0, 0.5, 1, 1.5, 2, 3, 4, 6]).all()
        assert np.array_equal(np.asarray(sf), np.asarray(sf.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)))
        fp32 = nvfp4.fake_quant_last(p, nonnegative=True)
        differ = np.mean(np.asarray(plain) != np.asarray(fp32))
        assert differ < 0.05, differ
        if p is not every:  # P not already bf16: bf16(P)'s group maxima and near-midpoint elements differ
            assert differ > 0
        if with_times:
            np.testing.assert_allclose(emulated, plain * times, rtol=2**-7, atol=0)  # two bf16 roundings


def test_probability_quantizer_float32_path_is_the_float32_quantizer():
    """For float16 (and float32) operands P̃ is the float32 quantizer; with ``times`` e2m1 · (sf·times) per group."""
    p, inv_l = _probability_groups(4)
    np.testing.assert_array_equal(nvfp4.fake_quant_probabilities(p, jnp.float16),
                                  nvfp4.fake_quant_last(p, nonnegative=True))
    got = nvfp4.fake_quant_probabilities(p, jnp.float16, times=inv_l)
    values, sf = nvfp4.fake_quant_parts(p, jnp.max(p, axis=-1, keepdims=True), nonnegative=True)
    np.testing.assert_array_equal(got, values * (sf * inv_l))
    np.testing.assert_allclose(got, nvfp4.fake_quant_last(p, nonnegative=True) * inv_l, rtol=2**-23)
