"""INT8 quantizer ψ and the bit tricks, against numpy oracles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.numerics import int8, sage_tiles


def np_quantize(x, axes):
    """float64 oracle: scale amax/127 (1 for zero groups), round half away from zero, clip."""
    x = np.asarray(x, np.float64)
    amax = np.abs(x).max(axis=axes, keepdims=True)
    scale = np.where(amax > 0, np.float32(amax) * np.float32(1 / 127), 1.0)
    y = x / scale
    codes = np.clip(np.sign(y) * np.floor(np.abs(y) + 0.5), -127, 127)
    return codes.astype(np.int8), scale


@pytest.mark.parametrize("axes", [-1, (-2, -1)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_matches_numpy(axes, dtype):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 16, 64)) * rng.uniform(0.01, 50, (3, 16, 1)), dtype)
    codes, scale = int8.quantize(x, axes)
    ref_codes, ref_scale = np_quantize(np.asarray(x, np.float32), axes)
    np.testing.assert_allclose(np.asarray(scale), ref_scale, rtol=1e-7)
    # Division by a float32 scale vs numpy's float64: at most an off-by-one at exact ties.
    diff = np.abs(np.asarray(codes, np.int32) - ref_codes.astype(np.int32))
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
    assert np.abs(np.asarray(codes)).max() == 127  # the group max maps to ±127
    err = np.abs(np.asarray(int8.dequantize(codes, scale)) - np.asarray(x, np.float32))
    assert np.all(err <= np.asarray(scale) * 0.5 + 1e-6)  # half a step at most


def test_zero_group_and_ties():
    x = jnp.array([[0.0, 0.0, 0.0, 0.0], [127.0, 0.5, -0.5, -1.5]], jnp.float32)
    codes, scale = int8.quantize(x, -1)
    assert np.asarray(scale)[0, 0] == 1.0 and np.all(np.asarray(codes)[0] == 0)
    # scale 1: ties round away from zero (not to even)
    np.testing.assert_array_equal(np.asarray(codes)[1], [127, 1, -1, -2])


@pytest.mark.parametrize("jit", [False, True])
def test_encode_is_spec_floor_form_for_every_float(jit):
    """encode_with_scale's trunc(y + copysign(0.5, y)) equals SPEC's floor(|y| + 0.5)·sign(y) (float32 sum,
    then clip) bit for bit: random values, every half-integer, both float neighbours of each, ±0, the
    largest float below ½, huge, denormal and infinite values."""
    rng = np.random.default_rng(5)
    base = np.concatenate([rng.uniform(-130, 130, 20000), np.arange(-128, 128.5, 0.5)]).astype(np.float32)
    near = [np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(-np.inf))]
    special = np.array([0.0, -0.0, 0.49999997, -0.49999997, 127.49999, 1e30, -1e30, np.inf, -np.inf, 1e-40,
                        -1e-40], np.float32)
    x = np.concatenate([base, *near, special])
    y = x * np.float32(1.0)
    r = np.floor(np.abs(y) + np.float32(0.5))
    want = np.clip(np.where(y < 0, -r, r), -127, 127).astype(np.int8)
    encode = jax.jit(int8.encode_with_scale) if jit else int8.encode_with_scale
    np.testing.assert_array_equal(np.asarray(encode(jnp.asarray(x), jnp.float32(1.0))), want)
    assert want[np.flatnonzero(x == np.float32(0.49999997))[0]] == 1  # the float32 sum rounds up here


def test_clip_at_127():
    codes = int8.encode_with_scale(jnp.array([300.0, -300.0, 126.6]), jnp.float32(1.0))
    np.testing.assert_array_equal(np.asarray(codes), [127, -127, 127])


def test_biased_float_is_exact():
    i = jnp.array([0, 1, -1, 2_064_512, -2_064_512, 4_129_024, 12345], jnp.int32)
    f = int8.int32_as_biased_float(i)
    np.testing.assert_array_equal(np.asarray(f, np.float64) - int8.MAGIC, np.asarray(i, np.float64))


def test_encode_unit_interval_rounds_half_even():
    rng = np.random.default_rng(2)
    e = np.concatenate([rng.uniform(0, 1, 1000), [0.0, 1.0, 0.5 / 127, 1.5 / 127]]).astype(np.float32)
    codes = np.asarray(int8.encode_unit_interval(jnp.asarray(e)))
    np.testing.assert_array_equal(codes, np.rint(e * np.float32(127)).astype(np.int8))
    assert codes.max() == 127 and codes.min() == 0


def test_qk_tile_per_block_and_smoothing():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((32, 64)) + 5.0, jnp.float32)
    valid = jnp.arange(32)[:, None] < 20
    mean = jnp.full((1, 64), 5.0)
    codes, scale, _ = sage_tiles.quantize_qk_tile(x, valid, mean, per_block=True, smooth_block=False, out_scale=2.0)
    assert np.all(np.asarray(codes)[20:] == 0)  # invalid rows are zero
    s = np.asarray(scale)
    assert np.all(s == s[0])  # one scale per block
    amax = np.abs(np.asarray(x)[:20] - 5.0).max()
    np.testing.assert_allclose(s[0], 2.0 * amax / 127, rtol=1e-6)
    codes_t, scale_t, bmean = sage_tiles.quantize_qk_tile(x, valid, None, per_block=False, smooth_block=True,
                                                          out_scale=1.0)
    np.testing.assert_allclose(np.asarray(bmean)[0], np.asarray(x)[:20].mean(0), rtol=1e-5)
    deq = np.asarray(codes_t, np.float32)[:20] * np.asarray(scale_t)[:20, None]
    np.testing.assert_allclose(deq, np.asarray(x)[:20] - np.asarray(bmean), atol=np.asarray(scale_t).max())


def test_quantizers_are_jittable_and_vmappable():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, 64))
    c1, s1 = jax.jit(int8.quantize)(x)
    c2, s2 = jax.vmap(int8.quantize)(x)
    np.testing.assert_array_equal(np.asarray(c1), np.asarray(c2))
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))


def test_encode_unit_interval_conversion_modes_agree():
    """The kernels' truncating form (low byte of the biased bits) equals the portable form."""
    e = jnp.asarray(np.random.default_rng(4).uniform(0, 1, 4096).astype(np.float32))
    portable = np.asarray(int8.encode_unit_interval(e))
    truncating = np.asarray(int8.encode_unit_interval(e, truncating_convert=True))
    np.testing.assert_array_equal(portable, truncating)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("truncating_convert", [False, True])
def test_half_even_codes_round_ties_to_even(jit, truncating_convert):
    """encode_half_even (SageBwd's dS): rne(x / scale) for |x / scale| ≤ 127, both forms (the reference's
    jnp.round and the kernels' magic-number low byte, negatives as two's complement): every half-integer, both
    float neighbours of each, random values, ±0; quantize_half_even's scale is quantize's."""
    rng = np.random.default_rng(7)
    base = np.concatenate([rng.uniform(-127, 127, 20000), np.arange(-127, 127.5, 0.5)]).astype(np.float32)
    near = [np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(-np.inf))]
    x = np.clip(np.concatenate([base, *near, np.array([0.0, -0.0], np.float32)]), -127, 127)
    want = np.rint(x).astype(np.int8)  # numpy's rint: half to even
    encode = lambda v: int8.encode_half_even(v, jnp.float32(1.0), truncating_convert=truncating_convert)  # noqa: E731
    got = np.asarray((jax.jit(encode) if jit else encode)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, want)
    assert list(np.asarray(encode(jnp.asarray([2.5, -2.5, 3.5, -0.5], jnp.float32)))) == [2, -2, 4, 0]
    y = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    codes, scale = int8.quantize_half_even(y, -1, truncating_convert=truncating_convert)
    ref_codes, ref_scale = int8.quantize(y, -1)
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(ref_scale))
    diff = np.abs(np.asarray(codes, np.int32) - np.asarray(ref_codes, np.int32))
    assert diff.max() <= 1 and np.abs(np.asarray(codes)).max() == 127
