"""The pair order of the fused SageBwd kernel's keys (``pallas_kernels.key_pairs``) and the ``stmatrix`` stores
(``pallas_kernels.stmatrix``) that write pair-ordered or lane-ordered (``pallas_kernels.lane_groups``) tiles back in
key order.

The stores are checked exactly three ways: interpreted on the CPU (their jax.numpy form), lowered for an abstract
H200 (the inline Mosaic GPU path must lower and be taken), and, on a Hopper GPU, compiled against numpy — the only
place the hand-computed swizzled addresses run. The kernel that uses them is held to the xla reference by
tests/test_sage_backward.py and tests/test_qat.py (the Mosaic backward kernels, causal and not, D64 and D128, in the
interpreter) and on the GPU by ``benchmarks/gpu_check.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import h200
from pallas_kernels import _mosaic as mos
from pallas_kernels import key_pairs, lane_groups, stmatrix


def test_pair_order_round_trip_and_key_of_row():
    x = jnp.arange(2 * 48 * 3).reshape(2, 48, 3)
    y = key_pairs.to_pair_order(x, 1)
    np.testing.assert_array_equal(key_pairs.from_pair_order(y, 1), x)
    rows = jnp.arange(48)
    # row r of the pair-ordered array holds key key_of_row(r); rows g and g + 8 of each 16 are keys 2g and 2g + 1
    np.testing.assert_array_equal(y[:, :, 0], x[:, key_pairs.key_of_row(rows), 0])
    np.testing.assert_array_equal(key_pairs.key_of_row(rows[:16]), [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15])
    assert sorted(np.asarray(key_pairs.key_of_row(rows)).tolist()) == list(range(48))
    with pytest.raises(ValueError, match="multiple of 16"):
        key_pairs.to_pair_order(jnp.zeros((2, 40)), 1)


def _store_kernel(kind: str, n: int, dtype, interpret: bool):
    """(a (64, n) int8, e (n, n) int8 permutation) → the tile t = a·eᵀ (a WGMMA result, as int8 or ``dtype``)
    stored by ``key_pairs.store_transposed`` (kind "transposed": out (n, 64)), ``key_pairs.store_rows`` ("rows")
    or ``stmatrix.store_rows`` with lane order's row map ("lanes"; out (64, n))."""
    def body(a_ref, e_ref, o_ref, a_s, e_s, o_s, bar):
        for i, (src, dst) in enumerate(((a_ref, a_s), (e_ref, e_s))):
            mos.plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
            mos.plgpu.barrier_wait(bar.at[i])
        t = mos.matmul((64, n), jnp.int32, a_s, e_s.T)
        if kind == "transposed":
            key_pairs.store_transposed(o_s, t.astype(jnp.int8), interpret)
        elif kind == "rows":
            key_pairs.store_rows(o_s, t.astype(jnp.float32).astype(dtype), interpret)
        else:
            stmatrix.store_rows(o_s, t.astype(jnp.float32).astype(dtype), interpret,
                                key_of_row=lane_groups.key_of_column, from_order=lane_groups.from_lane_order)
        mos.copy_out(((o_s, o_ref),))

    i8 = jnp.int8
    tiles = lambda rows, cols, dt=i8: mos.plgpu.SMEM((rows, cols), dt, transforms=mos.tile_transforms(dt, cols))  # noqa: E731
    out = (n, 64) if kind == "transposed" else (64, n)
    out_dtype = i8 if kind == "transposed" else dtype
    return mos.plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out, out_dtype),
                            scratch_types=[tiles(64, n), tiles(n, n), tiles(*out, out_dtype),
                                           mos.plgpu.Barrier(num_barriers=2)],
                            compiler_params=mos.compiler_params(), interpret=mos.interpret_params(interpret))


@pytest.mark.parametrize("kind, n, dtype", [("transposed", 64, jnp.int8), ("transposed", 128, jnp.int8),
                                            ("rows", 64, jnp.bfloat16), ("rows", 128, jnp.float16),
                                            ("lanes", 64, jnp.bfloat16), ("lanes", 128, jnp.bfloat16)])
def test_stores_put_pair_ordered_rows_in_natural_order(monkeypatch, kind, n, dtype):
    rng = np.random.default_rng(n + len(kind))
    a = rng.integers(-127, 128, (64, n)).astype(np.int8)
    perm = rng.permutation(n)
    e = np.eye(n, dtype=np.int8)[perm]  # t = a·eᵀ = a[:, perm]
    t = a[:, perm]
    undo = lane_groups.from_lane_order if kind == "lanes" else key_pairs.from_pair_order
    want = np.asarray(undo(jnp.asarray(t), 0))  # row r of t holds key key_of_row(r) (key_of_column for lanes)
    want = want.T if kind == "transposed" else want.astype(np.float32)
    got = np.asarray(_store_kernel(kind, n, dtype, interpret=True)(a, e))
    np.testing.assert_array_equal(got.astype(want.dtype), want)

    calls = []  # lowered for an H200, the inline Mosaic GPU store is taken (and lowers)
    inline = mos.plgpu.inline_mgpu
    monkeypatch.setattr(mos.plgpu, "inline_mgpu", lambda **kw: calls.append(1) or inline(**kw))
    assert "stmatrix" in h200.lower_for_h200(_store_kernel(kind, n, dtype, interpret=False), a, e).as_text()
    assert calls == [1]
    if mos.on_hopper():  # the hand-computed swizzled addresses, compiled
        got = np.asarray(_store_kernel(kind, n, dtype, interpret=False)(a, e))
        np.testing.assert_array_equal(got.astype(want.dtype), want)


def test_stores_reject_other_tiles():
    with pytest.raises(ValueError, match="store_transposed"):
        key_pairs.store_transposed(jnp.zeros((64, 64), jnp.int8), jnp.zeros((32, 64), jnp.int8), True)
    with pytest.raises(ValueError, match="store_rows"):
        key_pairs.store_rows(jnp.zeros((64, 64), jnp.float32), jnp.zeros((64, 64), jnp.float32), True)
