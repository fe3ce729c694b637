"""``warp_reduce.warp_any_above``: whether a row vector holds a value above a threshold, as the predicate of a
``lax.cond`` (the SageAttention forward's conditional rescaling). Compiled it is one ``vote.sync.any`` per warp,
so the branch is uniform within a warp (rows 16w … 16w + 15 of a 64-row tile) and may differ between warps;
interpreted it covers the whole tile. The compiled test lowers for an H200 anywhere and runs on a Hopper GPU."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import _mosaic, warp_reduce

THRESHOLD = 8.0


def _vote_kernel(interpret: bool):
    """a (64, 64) bf16, e (64, 64) bf16 → t = a·eᵀ (a float32 WGMMA tile); each row's maximum voted on, and a
    ``lax.cond`` on the vote: (64, 64) float32, the rows of a warp whose vote held all 1 + t, else t."""
    plgpu = _mosaic.plgpu

    def body(a_ref, e_ref, o_ref, a_s, e_s, o_s, bar):
        for i, (src, dst) in enumerate(((a_ref, a_s), (e_ref, e_s))):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
            plgpu.barrier_wait(bar.at[i])
        t = _mosaic.matmul((64, 64), jnp.float32, a_s, e_s.T)
        above = warp_reduce.warp_any_above(jnp.max(t, axis=1), THRESHOLD, interpret)
        o_s[...] = jax.lax.cond(above, lambda x: x + 1.0, lambda x: x, t)
        _mosaic.copy_out(((o_s, o_ref),))

    bf16 = jnp.bfloat16
    tile = lambda dt: plgpu.SMEM((64, 64), dt, transforms=_mosaic.tile_transforms(dt, 64))  # noqa: E731
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                        scratch_types=[tile(bf16), tile(bf16), plgpu.SMEM((64, 64), jnp.float32),
                                       plgpu.Barrier(num_barriers=2)],
                        num_threads=1, thread_name="wg", compiler_params=_mosaic.compiler_params(),
                        interpret=_mosaic.interpret_params(interpret))


def _inputs(seed: int, above: tuple[int, ...], nan_row: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Values in (−4, 4), one entry of each row in ``above`` set to 9 (past the threshold), and optionally a row
    holding a NaN (which is not above)."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(-4.0, 4.0, (64, 64)).astype(np.float32)
    for row in above:
        a[row, rng.integers(64)] = 9.0
    if nan_row is not None:
        a[nan_row, 5] = np.nan
    return a.astype(jnp.bfloat16), np.eye(64, dtype=jnp.bfloat16)


def _expected(a: np.ndarray, per_warp: bool) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        t = a.astype(np.float32) @ np.eye(64, dtype=np.float32)  # a NaN fills its row, as in the product
    rows_above = np.nan_to_num(t, nan=0.0).max(axis=1) > THRESHOLD
    if per_warp:
        hit = np.repeat(rows_above.reshape(4, 16).any(axis=1), 16)
    else:
        hit = np.full(64, rows_above.any())
    return np.where(hit[:, None], t + 1.0, t)


CASES = [((), None), ((3,), None), ((17, 40), 20), ((63,), 0)]


@pytest.mark.parametrize("above, nan_row", CASES)
def test_warp_vote_interpreted(above, nan_row):
    a, e = _inputs(len(above), above, nan_row)
    with jax.default_device(jax.devices("cpu")[0]):
        got = _vote_kernel(True)(a, e)
    np.testing.assert_array_equal(np.asarray(got), _expected(a, per_warp=False))  # NaN where NaN


def test_warp_vote_compiled(monkeypatch):
    """Lowered for an H200 on any machine (a spy sees the ``vote.sync`` route); on a Hopper GPU each warp's rows
    take the branch exactly when one of that warp's rows is above, NaN rows not counting."""
    import h200

    calls = []
    real = warp_reduce._warp_vote_above
    monkeypatch.setattr(warp_reduce, "_warp_vote_above", lambda *a: calls.append(1) or real(*a))
    kernel = _vote_kernel(False)
    a, e = _inputs(0, ())
    jax.clear_caches()
    h200.lower_for_h200(kernel, jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(e.shape, e.dtype))
    assert calls, "the compiled warp_any_above did not take the vote route"
    if not _mosaic.on_hopper():
        return
    for seed, (above, nan_row) in enumerate(CASES):
        a, e = _inputs(seed, above, nan_row)
        np.testing.assert_array_equal(np.asarray(kernel(a, e)), _expected(a, per_warp=True))


def test_warp_any_above_takes_a_row_vector():
    with pytest.raises(ValueError, match=r"a \(rows,\) row vector"):
        warp_reduce.warp_any_above(jnp.zeros((4, 4)), THRESHOLD, True)
