"""``warp_reduce.tile_absmax``: max |x| of a WGMMA tile as a scalar every thread of the warpgroup holds
(SageBwd's per-tile dS scale). Interpreted it is the row maxima re-read along the lanes; compiled one
``redux.sync`` per warp and four SMEM words in inline Mosaic GPU, which only the GPU runs: the compiled test below
lowers for an H200 anywhere and compares with numpy on a Hopper GPU, two
warpgroups reducing different tiles at once (each with its own scratch row, as the kernels do). The same for
``warp_reduce.column_reduce`` (the max and sum over a tile's rows, the producer decode kernel's)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import _mosaic, warp_reduce

WGS = 2


def _tile_max_kernel(interpret: bool, scratch_rows: int = 64, exchanged: bool = False):
    """a (WGS, 64, 64) bf16, e (64, 64) bf16 → per warpgroup w: t = a[w]·eᵀ (a float32 WGMMA tile) and the tile
    filled with ``tile_absmax(t)``: (WGS, 64, 64) float32. ``exchanged``: filled instead with the *other*
    warpgroup's maximum, re-read from its scratch by ``tile_absmax_of`` after a barrier both pass (as SageBwd's
    split dQ does)."""
    plgpu = _mosaic.plgpu

    def body(a_ref, e_ref, o_ref, a_s, e_s, o_s, red_s, bar, xbar):
        wg = jax.lax.axis_index("wg")
        for i, (src, dst) in enumerate(((a_ref.at[wg], a_s.at[wg]), (e_ref, e_s.at[wg]))):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[2 * wg + i])
            plgpu.barrier_wait(bar.at[2 * wg + i])
        t = _mosaic.matmul((64, 64), jnp.float32, a_s.at[wg], e_s.at[wg].T)
        m = warp_reduce.tile_absmax(t, red_s.at[wg], interpret)
        if exchanged:
            plgpu.barrier_arrive(xbar)
            plgpu.barrier_wait(xbar)
            m = warp_reduce.tile_absmax_of(red_s.at[1 - wg], interpret)
        o_s[wg] = jnp.maximum(t * 0.0, m)  # every entry m (m > 0; t finite)
        _mosaic.copy_out(((o_s.at[wg], o_ref.at[wg]),))

    bf16 = jnp.bfloat16
    tiles = lambda dt: plgpu.SMEM((WGS, 64, 64), dt, transforms=_mosaic.tile_transforms(dt, 64))  # noqa: E731
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((WGS, 64, 64), jnp.float32),
                        scratch_types=[tiles(bf16), tiles(bf16), plgpu.SMEM((WGS, 64, 64), jnp.float32),
                                       plgpu.SMEM((WGS, scratch_rows), jnp.float32), plgpu.Barrier(num_barriers=2 * WGS),
                                       plgpu.Barrier(num_arrivals=WGS)],
                        num_threads=WGS, thread_name="wg", compiler_params=_mosaic.compiler_params(),
                        interpret=_mosaic.interpret_params(interpret))


def _inputs(seed: int, where: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Two N(0, 1) tiles, the second scaled by 3, each with its largest |value| planted at ``where`` (a row in
    some warp: rows 16w … 16w + 15 belong to warp w) with a sign that differs between them."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((WGS, 64, 64)).astype(np.float32)
    a[1] *= 3.0
    for w in range(WGS):
        a[w][where] = (-1.0) ** w * (np.abs(a[w]).max() + 1.0 + w)
    return a.astype(jnp.bfloat16), np.eye(64, dtype=jnp.bfloat16)


def _expected(a: np.ndarray, exchanged: bool = False) -> np.ndarray:
    m = np.abs(a.astype(np.float32)).max(axis=(1, 2))
    return np.broadcast_to((m[::-1] if exchanged else m)[:, None, None], a.shape)


@pytest.mark.parametrize("exchanged", [False, True])
@pytest.mark.parametrize("where", [(3, 60), (37, 1), (63, 31)])
def test_tile_max_interpreted(where, exchanged):
    a, e = _inputs(len(where) + where[0], where)
    with jax.default_device(jax.devices("cpu")[0]):  # the interpreter's warpgroups wait for each other in host
        got = _tile_max_kernel(True, exchanged=exchanged)(a, e)  # callbacks, which a GPU backend may run one at a time
    np.testing.assert_array_equal(np.asarray(got), _expected(a, exchanged))


@pytest.mark.parametrize("exchanged", [False, True])
def test_tile_max_compiled(monkeypatch, exchanged):
    """Lowered for an H200 on any machine (the inline ``redux.sync`` route is the one lowered); compiled on a
    Hopper GPU against numpy, the maximum planted in each warp in turn; ``exchanged``, each warpgroup's re-read
    of the other's four words (``tile_absmax_of``)."""
    import h200

    calls = []
    real = warp_reduce._warp_absmax
    monkeypatch.setattr(warp_reduce, "_warp_absmax", lambda *a: calls.append(1) or real(*a))
    kernel = _tile_max_kernel(False, exchanged=exchanged)
    a, e = _inputs(0, (0, 0))
    jax.clear_caches()
    h200.lower_for_h200(kernel, jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(e.shape, e.dtype))
    assert calls, "the compiled tile_absmax did not take the warp-level route"
    if not _mosaic.on_hopper():
        return
    for seed, row in enumerate((5, 16 + 9, 32 + 2, 48 + 15)):
        a, e = _inputs(seed, (row, 7 * seed + 3))
        np.testing.assert_array_equal(np.asarray(kernel(a, e)), _expected(a, exchanged))


def test_tile_absmax_rejects_a_scratch_of_another_length():
    import h200

    a, e = _inputs(0, (0, 0))
    with pytest.raises(ValueError, match=r"a \(rows,\) scratch"):
        h200.lower_for_h200(_tile_max_kernel(False, scratch_rows=60), jax.ShapeDtypeStruct(a.shape, a.dtype),
                              jax.ShapeDtypeStruct(e.shape, e.dtype))


def _column_kernel(interpret: bool, n: int):
    """a (WGS, 64, 64) bf16, e (n, 64) bf16 → per warpgroup w: t = a[w]·eᵀ (a (64, n) float32 WGMMA tile), then
    ``column_reduce(t)``'s max and sum: (WGS, 2, n) float32, both warpgroups reducing at once."""
    plgpu = _mosaic.plgpu

    def body(a_ref, e_ref, o_ref, a_s, e_s, o_s, red_s, bar):
        wg = jax.lax.axis_index("wg")
        for i, (src, dst) in enumerate(((a_ref.at[wg], a_s.at[wg]), (e_ref, e_s.at[wg]))):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[2 * wg + i])
            plgpu.barrier_wait(bar.at[2 * wg + i])
        t = _mosaic.matmul((64, n), jnp.float32, a_s.at[wg], e_s.at[wg].T)
        o_s[wg, 0] = warp_reduce.column_reduce(t, red_s.at[wg], "max", interpret)
        o_s[wg, 1] = warp_reduce.column_reduce(t, red_s.at[wg], "sum", interpret)
        _mosaic.copy_out(((o_s.at[wg], o_ref.at[wg]),))

    bf16 = jnp.bfloat16
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((WGS, 2, n), jnp.float32),
        scratch_types=[plgpu.SMEM((WGS, 64, 64), bf16, transforms=_mosaic.tile_transforms(bf16, 64)),
                       plgpu.SMEM((WGS, n, 64), bf16, transforms=_mosaic.tile_transforms(bf16, 64)),
                       plgpu.SMEM((WGS, 2, n), jnp.float32), plgpu.SMEM((WGS, 4, n), jnp.float32),
                       plgpu.Barrier(num_barriers=2 * WGS)],
        num_threads=WGS, thread_name="wg", compiler_params=_mosaic.compiler_params(),
        interpret=_mosaic.interpret_params(interpret))


def _column_inputs(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two (64, 64) tiles of small integers (exact sums in float32), the second scaled by 3, each with its column
    maxima planted in a different warp's rows, and e = the first n rows of the identity (t = a[w][:, :n])."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-8, 8, (WGS, 64, 64)).astype(np.float32)
    a[1] *= 3.0
    for w in range(WGS):
        for col in range(n):
            a[w, (16 * (col + w) + col) % 64, col] = 100.0 + col + w
    return a.astype(jnp.bfloat16), np.eye(64, dtype=jnp.bfloat16)[:n]


def _column_expected(a: np.ndarray, n: int) -> np.ndarray:
    t = a.astype(np.float32)[:, :, :n]
    return np.stack([t.max(axis=1), t.sum(axis=1)], axis=1)


@pytest.mark.parametrize("n", [8, 16, 64])
def test_column_reduce_interpreted(n):
    a, e = _column_inputs(n, n)
    with jax.default_device(jax.devices("cpu")[0]):
        got = _column_kernel(True, n)(a, e)
    np.testing.assert_array_equal(np.asarray(got), _column_expected(a, n))


@pytest.mark.parametrize("n", [8, 16, 64])
def test_column_reduce_compiled(monkeypatch, n):
    """Lowered for an H200 on any machine (the inline route); compiled on a Hopper GPU against numpy, both
    warpgroups reducing at once through their own scratch rows."""
    import h200

    calls = []
    real = warp_reduce._column_reduce
    monkeypatch.setattr(warp_reduce, "_column_reduce", lambda *a: calls.append(1) or real(*a))
    kernel = _column_kernel(False, n)
    a, e = _column_inputs(n, n)
    jax.clear_caches()
    h200.lower_for_h200(kernel, jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(e.shape, e.dtype))
    assert len(calls) == 2, "the compiled column_reduce did not take the inline route"
    if _mosaic.on_hopper():
        np.testing.assert_array_equal(np.asarray(kernel(a, e)), _column_expected(a, n))


def test_column_reduce_checks_its_arguments():
    x = jnp.zeros((64, 16), jnp.float32)
    with pytest.raises(ValueError, match="kind"):
        warp_reduce.column_reduce(x, jnp.zeros((4, 16), jnp.float32), "min", True)
    with pytest.raises(ValueError, match="scratch"):
        warp_reduce.column_reduce(x, jnp.zeros((4, 8), jnp.float32), "max", True)
