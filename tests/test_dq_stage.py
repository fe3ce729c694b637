"""The float32 dQ stage's permuted column order (``pallas_kernels.dq_stage``): a model of its stores' addresses
(conflict-free, each stage byte written once, the columns ``column_of`` says) and the un-permutation applied to
the accumulator. The compiled store itself runs only on the GPU (``benchmarks/gpu_check.py`` compares the
gradients with the xla reference); its lowering is covered by tests/test_lowering.py."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import lowbit_jax as lb

from pallas_kernels import _mosaic, dq_stage, reduce_add


def _position(offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, first column) of a 16-byte piece at a byte offset of the (64, 64) float32 stage, tiled (8, 32) with the
    128-byte swizzle undone (as ``dq_stage.byte_offsets`` lays it out)."""
    tile_bytes, col_tile_bytes, row_bytes = dq_stage.STRIDES
    row_tile, col_tile = offset // tile_bytes, (offset % tile_bytes) // col_tile_bytes
    row_in_tile = (offset % col_tile_bytes) // row_bytes
    chunk = ((offset % row_bytes) // 16) ^ row_in_tile
    return row_tile * 8 + row_in_tile, col_tile * 32 + chunk * 4


def test_column_order_is_a_permutation_that_unpermute_inverts():
    cols = np.arange(64)
    assert sorted(dq_stage.column_of(cols)) == list(range(64))
    rng = np.random.default_rng(0)
    for d in (64, 128):
        natural = rng.standard_normal((3, 5, d)).astype(np.float32)
        stored = np.empty_like(natural)
        for chunk in range(d // 64):
            stored[..., chunk * 64 + dq_stage.column_of(cols)] = natural[..., chunk * 64 + cols]
        np.testing.assert_array_equal(np.asarray(dq_stage.unpermute(jnp.asarray(stored))), natural)
    with pytest.raises(ValueError, match="multiple of 64"):
        dq_stage.unpermute(jnp.zeros((2, 96)))


def test_stores_are_conflict_free_and_cover_the_stage_once():
    written = []
    for warp in range(4):
        for half in (0, 1):
            for k in range(4):
                offsets = dq_stage.byte_offsets(k, half, warp)
                assert np.all(offsets % 16 == 0)
                for phase in range(4):  # a 16-byte store is served 8 lanes (128 bytes) at a time
                    banks = (offsets[phase * 8:(phase + 1) * 8] // 16) % 8
                    assert len(set(banks.tolist())) == 8, (warp, half, k, phase, banks)
                written += offsets.tolist()
    assert sorted(written) == list(range(0, 64 * 64 * 4, 16))  # every 16 bytes of the stage exactly once


def test_each_piece_holds_the_columns_column_of_names():
    lanes = np.arange(32)
    g, c = lanes // 4, lanes % 4
    for warp in range(4):
        for half in (0, 1):
            for k in range(4):
                row, col = _position(dq_stage.byte_offsets(k, half, warp))
                np.testing.assert_array_equal(row, 16 * warp + 8 * half + g)
                # the piece holds the thread's WGMMA columns 8j + 2c, 8j + 2c + 1 for j = 2k, 2k + 1
                for e, d in enumerate((16 * k + 2 * c, 16 * k + 2 * c + 1, 16 * k + 8 + 2 * c, 16 * k + 9 + 2 * c)):
                    np.testing.assert_array_equal(dq_stage.column_of(d), col + e)


def test_accumulator_total_is_unpermuted_only_for_a_permuted_stage():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8, 3, 128)), jnp.float32)
    np.testing.assert_array_equal(reduce_add.reduce_add_total(x, 0, interpret=False, permuted=True),
                                  dq_stage.unpermute(x))
    np.testing.assert_array_equal(reduce_add.reduce_add_total(x, 0, interpret=False), x)
    np.testing.assert_array_equal(reduce_add.reduce_add_total(x[None], 1, interpret=True), x)
    assert dq_stage.permutes(64, False) and not dq_stage.permutes(64, True) and not dq_stage.permutes(128, False)


def test_stage_order_choice():
    """``dq_stage.permutes``' ``order`` (the configs' ``dq_stage_order``): "auto" at head dim 64, "permuted" at
    either head dim (each warpgroup's stage is one 64-column tile), "natural" never, and never interpreted."""
    assert [dq_stage.permutes(d, False, "permuted") for d in (64, 128)] == [True, True]
    assert not any(dq_stage.permutes(d, i, o) for d in (64, 128) for i, o in ((False, "natural"), (True, "permuted")))
    with pytest.raises(ValueError, match="order"):
        dq_stage.permutes(64, False, "swizzled")
    for config in (lb.SageFwdConfig, lb.QatConfig):
        with pytest.raises(ValueError, match="dq_stage_order"):
            config(dq_stage_order="swizzled")
    with pytest.raises(ValueError, match="split_dq_schedule"):
        lb.SageFwdConfig(split_dq_schedule="before_dv")


@pytest.mark.parametrize("method, head_dim, config, stores", [
    ("sage", 64, {}, 1), ("sage", 128, {}, 0), ("qat", 64, {}, 1), ("qat", 128, {}, 0),
    ("sage", 128, dict(dq_stage_order="permuted"), 1), ("qat", 128, dict(dq_stage_order="permuted"), 1),
    ("sage", 64, dict(dq_stage_order="natural"), 0), ("sage", 128, dict(split_dq_schedule="under_dk"), 0),
    ("sage", 128, dict(split_dq_schedule="under_dk", dq_stage_order="permuted"), 1)])
def test_fused_backwards_take_the_permuted_stage_where_measured_faster(monkeypatch, method, head_dim, config, stores):
    """Lowered for an H200: the fused SageBwd and Attn-QAT kernels store their dQ stage through ``dq_stage.store``
    by default at head dim 64 only (``dq_stage.permutes``; ``dq_stage_order`` overrides it, at 128 for each
    warpgroup's 64-column half of the split dQ, with either ``split_dq_schedule``), and the accumulator is put back
    by ``unpermute``."""
    from h200 import lower_mosaic_fwd_bwd

    calls = []
    for name in ("store", "unpermute"):
        real = getattr(dq_stage, name)
        monkeypatch.setattr(dq_stage, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    jax.clear_caches()  # another test may have lowered the same call: its cached trace would skip the spies
    lower_mosaic_fwd_bwd(method, head_dim, True, seq=256, **config)
    assert calls == ["store", "unpermute"] * stores


def _stage_kernel(interpret: bool = False):
    """a (64, 64) bf16, e (64, 64) bf16 → t = a·eᵀ (a float32 WGMMA tile), stored by ``dq_stage.store`` into a
    stage tile and copied out: (64, 64) float32."""
    def body(a_ref, e_ref, o_ref, a_s, e_s, o_s, bar):
        for i, (src, dst) in enumerate(((a_ref, a_s), (e_ref, e_s))):
            _mosaic.plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
            _mosaic.plgpu.barrier_wait(bar.at[i])
        dq_stage.store(o_s, _mosaic.matmul((64, 64), jnp.float32, a_s, e_s.T))
        _mosaic.copy_out(((o_s, o_ref),))

    bf16 = jnp.bfloat16
    tile = lambda rows, cols, dt: _mosaic.plgpu.SMEM((rows, cols), dt, transforms=_mosaic.tile_transforms(dt, cols))  # noqa: E731
    return _mosaic.plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                                scratch_types=[tile(64, 64, bf16), tile(64, 64, bf16),
                                               _mosaic.plgpu.SMEM((64, 64), jnp.float32,
                                                                  transforms=dq_stage.stage_transforms()),
                                               _mosaic.plgpu.Barrier(num_barriers=2)],
                                compiler_params=_mosaic.compiler_params(),
                                interpret=_mosaic.interpret_params(interpret))


def test_stage_store_compiled():
    """Lowered for an H200 on any machine; compiled on a Hopper GPU against numpy (the only place the inline Mosaic
    GPU runs; passed on the H200, forty-fourth session): the stage holds t's columns where ``column_of`` says."""
    import h200

    rng = np.random.default_rng(7)
    a = rng.standard_normal((64, 64)).astype(jnp.bfloat16)
    e = np.eye(64, dtype=jnp.bfloat16)
    kernel = _stage_kernel()
    h200.lower_for_h200(kernel, jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(e.shape, e.dtype))
    if not _mosaic.on_hopper():
        return
    got = np.asarray(kernel(a, e))
    np.testing.assert_array_equal(got[:, dq_stage.column_of(np.arange(64))], a.astype(np.float32))
