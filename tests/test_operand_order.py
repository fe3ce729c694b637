"""Operand order (``pallas_kernels.operand_order``): an INT8 accumulator tile used as the register A operand of the
next ``wgmma`` with no lane shuffle, its B operand's contraction index permuted to match.

The repack is checked exactly three ways, as the ``stmatrix`` stores are (tests/test_key_pairs.py): interpreted on
the CPU (its jax.numpy form), lowered for an abstract H200 (the inline Mosaic GPU repack must lower and be taken),
and, on a Hopper GPU, compiled. The SageAttention kernels that use it are held to the xla reference by
tests/test_sage_backward.py (the Mosaic forward and backward in the interpreter, causal and not, GQA, D64 and D128);
here they must give the natural order's values exactly and take the repack where it is enabled.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit_jax as lb
import h200
from pallas_kernels import _mosaic as mos
from pallas_kernels import operand_order, sage_bwd_mosaic, sage_fwd_mosaic
from tests.attention_base import INTERPRET, make_qkv


def test_operand_order_round_trip_and_positions():
    x = jnp.arange(2 * 48 * 3).reshape(2, 48, 3)
    y = operand_order.to_operand_order(x, 1)
    np.testing.assert_array_equal(operand_order.from_operand_order(y, 1), x)
    # position 4c + 2h + l of each 16 holds entry 8h + 2c + l: a lane's two accumulator column pairs, side by side
    want = [8 * h + 2 * c + l for c in range(4) for h in range(2) for l in range(2)]
    np.testing.assert_array_equal(y[0, :16, 0], np.asarray(want) * 3)
    np.testing.assert_array_equal(y[0, 16:32, 0], (np.asarray(want) + 16) * 3)
    with pytest.raises(ValueError, match="multiple of 16"):
        operand_order.to_operand_order(jnp.zeros((2, 40)), 1)


def _product_kernel(n: int, d: int, interpret: bool):
    """(a (64, n) int8, e (n, n) int8 permutation, w (d, n) int8: Wᵀ with its n columns in operand order) →
    t·W as float32 (64, d), where t = a·eᵀ is a WGMMA result taken as the A operand by
    ``operand_order.register_operand``."""
    def body(a_ref, e_ref, w_ref, o_ref, a_s, e_s, w_s, t_s, o_s, bar):
        for i, (src, dst) in enumerate(((a_ref, a_s), (e_ref, e_s), (w_ref, w_s))):
            mos.plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
            mos.plgpu.barrier_wait(bar.at[i])
        t = mos.matmul((64, n), jnp.int32, a_s, e_s.T).astype(jnp.int8)
        op = operand_order.register_operand(t, t_s, interpret)
        o_s[...] = mos.matmul((64, d), jnp.int32, op, w_s.T).astype(jnp.float32)
        mos.copy_out(((o_s, o_ref),))

    i8 = jnp.int8
    tiles = lambda rows, cols: mos.plgpu.SMEM((rows, cols), i8, transforms=mos.tile_transforms(i8, cols))  # noqa: E731
    return mos.plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, d), jnp.float32),
                            scratch_types=[tiles(64, n), tiles(n, n), tiles(d, n), tiles(64, n),
                                           mos.plgpu.SMEM((64, d), jnp.float32), mos.plgpu.Barrier(num_barriers=3)],
                            compiler_params=mos.compiler_params(), interpret=mos.interpret_params(interpret))


@pytest.mark.parametrize("n, d", [(64, 64), (128, 64), (64, 128)])
def test_register_operand_contracts_in_operand_order(monkeypatch, n, d):
    rng = np.random.default_rng(n + d)
    a = rng.integers(-127, 128, (64, n)).astype(np.int8)
    perm = rng.permutation(n)
    e = np.eye(n, dtype=np.int8)[perm]
    w = rng.integers(-127, 128, (n, d)).astype(np.int8)
    want = a[:, perm].astype(np.int64) @ w.astype(np.int64)  # |entries| < 2**21: exact in float32
    w_t = np.asarray(operand_order.to_operand_order(jnp.asarray(w.T), 1))
    got = np.asarray(_product_kernel(n, d, interpret=True)(a, e, w_t))
    np.testing.assert_array_equal(got, want)
    natural = np.asarray(_product_kernel(n, d, interpret=True)(a, e, np.ascontiguousarray(w.T)))
    assert np.abs(natural - want).max() > 0  # the order matters: the test can fail

    calls = []  # lowered for an H200, the inline Mosaic GPU repack is taken (and lowers)
    inline = mos.plgpu.inline_mgpu
    monkeypatch.setattr(mos.plgpu, "inline_mgpu", lambda **kw: calls.append(1) or inline(**kw))
    h200.lower_for_h200(_product_kernel(n, d, interpret=False), a, e, w_t)
    assert calls == [1]
    if mos.on_hopper():  # the repack compiled: register for register the 8-bit operand layout
        np.testing.assert_array_equal(np.asarray(_product_kernel(n, d, interpret=False)(a, e, w_t)), want)


def test_register_operand_rejects_other_tiles():
    with pytest.raises(ValueError, match="register_operand"):
        operand_order.register_operand(jnp.zeros((64, 40), jnp.int8), None, True)
    with pytest.raises(ValueError, match="register_operand"):
        operand_order.register_operand(jnp.zeros((64, 64), jnp.float32), None, True)


MOSAIC = lb.SageFwdConfig(block_q=64, block_k=128, dkdv_backend="mosaic", dq_backend="mosaic", fwd_backend="mosaic")


def _sage_grads(q, k, v, do, causal, interpret=INTERPRET):
    def loss(q, k, v):
        o = lb.sage_attention(q, k, v, causal=causal, config=MOSAIC, implementation="pallas", interpret=interpret)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o
    (_, o), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (o, *g)


def test_quantize_kernels_write_operand_order():
    """The Triton producers of the B operands write them in operand order when asked (in-kernel, no extra pass):
    Q̂ᵀ (``sage_quantize_q``), V̂ᵀ (``sage_quantize_kv``), dÔᵀ (``sage_bwd_preprocess``); ragged lengths."""
    from pallas_kernels import quantize, sage_bwd

    q, k, v = make_qkv(2, 200, 136, 2, 1, 64, seed=4)
    kw = dict(block=64, per_block=True, smooth_block=False, out_scale=0.3, transposed=True, interpret=INTERPRET)
    natural, permuted = (quantize.sage_quantize_q(q, t_operand_order=flag, **kw) for flag in (False, True))
    np.testing.assert_array_equal(permuted[0], natural[0])
    np.testing.assert_array_equal(permuted[3], operand_order.to_operand_order(natural[3], 3))
    k_mean = jnp.mean(k.astype(jnp.float32), axis=1)  # (B, Hkv, D)
    v_scale = jnp.max(jnp.abs(v.astype(jnp.float32)), axis=1) / 127
    kv = [quantize.sage_quantize_kv(k, v, k_mean, v_scale, block=32, per_block=True, transposed=True,
                                    v_operand_order=flag, interpret=INTERPRET)
          for flag in (False, True)]
    for i in (0, 1, 3):
        np.testing.assert_array_equal(kv[1][i], kv[0][i])
    np.testing.assert_array_equal(kv[1][2], operand_order.to_operand_order(kv[0][2], 3))
    do = jax.random.normal(jax.random.PRNGKey(1), q.shape, q.dtype)
    pre = [sage_bwd.sage_bwd_preprocess(q, do, config=MOSAIC, operand_order=flag, interpret=INTERPRET)
           for flag in (False, True)]
    np.testing.assert_array_equal(pre[1][1], operand_order.to_operand_order(pre[0][1], 3))
    assert np.abs(np.asarray(pre[1][1], np.int32) - np.asarray(pre[0][1], np.int32)).max() > 0
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize.sage_quantize_kv(k, v, None, v_scale, block=8, per_block=True, v_operand_order=True,
                                  interpret=INTERPRET)


def test_sage_forward_returns_natural_residuals():
    """``lb.sage_forward`` documents V̂ᵀ (B, Hkv, D, Sk_pad) in natural key order: with the Mosaic forward (which
    was given V̂ᵀ in operand order) the residuals it returns equal the xla reference's codes."""
    from lowbit_jax import sage as sage_mod
    from lowbit_jax.sage_backends import SageCall, orders_for

    q, k, v = make_qkv(1, 256, 256, 2, 1, 64, seed=8, k_outlier=3.0)
    opts = sage_mod.resolve_options(q, k, v, implementation="pallas", interpret=INTERPRET, config=MOSAIC)
    call = SageCall.of_inputs(q, k, opts)
    assert orders_for(call).v  # the case under test: V̂ᵀ went to the kernel in operand order
    _, _, ops_p = lb.sage_forward(q, k, v, implementation="pallas", interpret=INTERPRET, config=MOSAIC)
    _, _, ops_x = lb.sage_forward(q, k, v, implementation="xla", config=MOSAIC)
    np.testing.assert_array_equal(np.asarray(ops_p.vt), np.asarray(ops_x.vt))
    assert not orders_for(call._replace(opts=dataclasses.replace(opts, implementation="xla"))).v
