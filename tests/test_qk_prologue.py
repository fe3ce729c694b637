"""The fused QK-norm + RoPE prologue of SageAttention (``sage_attention(..., prologue=QKPrologue(...))``).

The prologue's values are the model's own (``nnx.RMSNorm`` then rotate-half RoPE, 16-bit roundings included),
the quantize kernels with a prologue give the codes of the kernels without one on the prologue's output, the
Triton backward pass equals the reference backward, and ``sage_attention`` with a prologue equals the unfused
composition, values and gradients (the norm scales' included), on awkward shapes.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit_jax as lb
from lowbit_jax import rel_l1
from pallas_kernels.numerics import qk_prologue as P
from models.attention import rope
from models.presets import model_config
from models.transformer import TransformerLM
from pallas_kernels import quantize
from pallas_kernels.qk_prologue import qk_prologue_bwd

EPS = 1e-6


def _inputs(b, s, hq, hkv, d, dtype=jnp.bfloat16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = (2.0 * jax.random.normal(ks[0], (b, s, hq, d))).astype(dtype)
    k = (2.0 * jax.random.normal(ks[1], (b, s, hkv, d)) + 0.5).astype(dtype)  # a mean for K-smoothing to remove
    v = jax.random.normal(ks[2], (b, s, hkv, d)).astype(dtype)
    do = jax.random.normal(ks[3], (b, s, hq, d)).astype(dtype)
    g = (1.0 + 0.3 * jax.random.normal(ks[4], (2, d))).astype(dtype)
    return q, k, v, do, g[0], g[1]


def _assert_codes_match(got, want):
    """INT8 codes equal but for a rare ±1 (a row's rsqrt may differ in its last bit: the kernel's tile sums
    channels in another order than XLA's whole-array reduction)."""
    diff = np.abs(np.asarray(got, np.int32) - np.asarray(want, np.int32))
    assert diff.max() <= 1 and np.mean(diff != 0) < 1e-4, (diff.max(), np.mean(diff != 0))


def _prologue(s, d, gq, gk, *, norm=True, rope_on=True):
    cos, sin = lb.rope_tables(jnp.arange(s), d) if rope_on else (None, None)
    return lb.QKPrologue(gq if norm else None, gk if norm else None, cos, sin, cos, sin, eps=EPS)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_apply_is_the_models_norm_then_rope_bit_for_bit(dtype):
    """``qk_prologue.apply`` = ``nnx.RMSNorm`` (scale promoted to the model dtype) then the model's ``rope``:
    bit for bit in bf16; in fp16 (10 mantissa bits: float32 rounding differences of the two programs show) a
    last-bit difference in a few elements."""
    b, s, h, d = 2, 50, 3, 64
    x = (3.0 * jax.random.normal(jax.random.key(1), (b, s, h, d))).astype(dtype)
    norm = nnx.RMSNorm(d, dtype=dtype, rngs=nnx.Rngs(0))
    norm.scale[...] = 1.0 + 0.2 * jax.random.normal(jax.random.key(2), (d,))
    want = rope(norm(x), jnp.arange(s), 10000.0)
    cos, sin = lb.rope_tables(jnp.arange(s), d)
    got = jax.jit(lambda x, g: P.apply(x, g, cos, sin, eps=norm.epsilon))(x, norm.scale[...].astype(dtype))
    assert got.dtype == want.dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(got, want)
    else:
        ulp = np.spacing(np.maximum(np.abs(got), np.abs(want)).astype(np.float16)).astype(np.float32)
        assert np.all(np.abs(got - want) <= ulp) and np.mean(got != want) < 0.01


@pytest.mark.parametrize("norm,rope_on", [(True, True), (True, False), (False, True)])
def test_backward_halves_is_autodiff_of_apply(norm, rope_on):
    """The hand-written backward equals ``jax.vjp`` of the reference prologue (float32 scale: no rounding of
    its cotangent), also for a norm alone and RoPE alone."""
    b, s, h, d = 2, 33, 2, 64
    x = (2.0 * jax.random.normal(jax.random.key(3), (b, s, h, d))).astype(jnp.bfloat16)
    dz = jax.random.normal(jax.random.key(4), x.shape).astype(jnp.bfloat16)
    g = (1.0 + 0.2 * jax.random.normal(jax.random.key(5), (d,))) if norm else None
    cos, sin = lb.rope_tables(jnp.arange(s), d) if rope_on else (None, None)
    dx, dg = P.apply_backward(x, dz, g, cos, sin, eps=EPS)
    if norm:
        want_dx, want_dg = jax.vjp(lambda x, g: P.apply(x, g, cos, sin, eps=EPS), x, g)[1](dz)
        assert rel_l1(dg, want_dg) < 1e-5
    else:
        (want_dx,) = jax.vjp(lambda x: P.apply(x, None, cos, sin, eps=EPS), x)[1](dz)
        assert dg is None
    assert rel_l1(dx, want_dx) < 1e-3  # bf16 outputs: at most a last-bit difference here and there
    assert float(jnp.mean((dx != want_dx).astype(jnp.float32))) < 0.01


@pytest.mark.parametrize("d,s,norm,rope_on", [(64, 77, True, True), (128, 130, True, False), (64, 64, False, True)])
def test_quantize_kernels_with_the_prologue_quantize_its_output(d, s, norm, rope_on):
    """Interpreted, the three quantize kernels given the pre-norm q, k and a prologue produce the codes and
    scales that they produce given ``qk_prologue.apply``'s output (ragged lengths, GQA, transposed copies)."""
    q, k, v, _, gq, gk = _inputs(2, s, 4, 2, d)
    pro = _prologue(s, d, gq, gk, norm=norm, rope_on=rope_on)
    qz, kz = P.apply(q, *pro.side("q"), eps=EPS), P.apply(k, *pro.side("k"), eps=EPS)
    kw = dict(block=64, per_block=True, smooth_block=False, out_scale=0.3, transposed=True, t_operand_order=True,
              interpret=True)
    got, want = quantize.sage_quantize_q(q, pro, **kw), quantize.sage_quantize_q(qz, None, **kw)
    for a, w in zip((got[0], got[3]), (want[0], want[3])):
        _assert_codes_match(a, w)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)
    (km, vs), (km_w, vs_w) = (quantize.sage_channel_stats(k, v, pro, smooth_k=True, interpret=True),
                              quantize.sage_channel_stats(kz, v, None, smooth_k=True, interpret=True))
    np.testing.assert_allclose(np.asarray(km), np.asarray(km_w), atol=2e-4)  # summation order
    np.testing.assert_array_equal(np.asarray(vs), np.asarray(vs_w))
    kkw = dict(block=64, per_block=True, transposed=True, v_operand_order=True, interpret=True)
    got, want = (quantize.sage_quantize_kv(k, v, km_w, vs_w, pro, **kkw),
                 quantize.sage_quantize_kv(kz, v, km_w, vs_w, None, **kkw))
    for i in (0, 2, 3):
        _assert_codes_match(got[i], want[i])
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)


@pytest.mark.parametrize("d,s,norm,rope_on,dtype", [(64, 77, True, True, jnp.bfloat16),
                                                     (128, 40, True, False, jnp.float16),
                                                     (64, 130, False, True, jnp.bfloat16)])
def test_backward_kernel_matches_the_reference(d, s, norm, rope_on, dtype):
    """``qk_prologue_bwd`` (interpreted; ragged rows masked) = ``qk_prologue.apply_backward``."""
    x, _, _, dz, g, _ = _inputs(2, s, 3, 1, d, dtype)
    cos, sin = lb.rope_tables(jnp.arange(s), d) if rope_on else (None, None)
    g = g if norm else None
    dx, dg = qk_prologue_bwd(x, dz, g, cos, sin, eps=EPS, interpret=True)
    want_dx, want_dg = P.apply_backward(x, dz, g, cos, sin, eps=EPS)
    assert dx.dtype == x.dtype and rel_l1(dx, want_dx) < 1e-6
    if norm:
        assert rel_l1(dg, want_dg) < 1e-5
    else:
        assert dg is None


def _fused_and_unfused(q, k, v, do, gq, gk, *, causal, impl, norm=True, rope_on=True):
    s_q, s_k, d = q.shape[1], k.shape[1], q.shape[3]
    cq, sq_ = lb.rope_tables(jnp.arange(s_k - s_q, s_k), d) if rope_on else (None, None)  # queries are the last
    ck, sk_ = lb.rope_tables(jnp.arange(s_k), d) if rope_on else (None, None)
    kw = dict(causal=causal, implementation=impl, interpret=impl == "pallas")

    def fused(q, k, v, gq, gk):
        pro = lb.QKPrologue(gq if norm else None, gk if norm else None, cq, sq_, ck, sk_, eps=EPS)
        return lb.sage_attention(q, k, v, prologue=pro, **kw)

    def unfused(q, k, v, gq, gk):
        qz = P.apply(q, gq if norm else None, cq, sq_, eps=EPS)
        kz = P.apply(k, gk if norm else None, ck, sk_, eps=EPS)
        return lb.sage_attention(qz, kz, v, **kw)

    out = {}
    for name, fn in (("fused", fused), ("unfused", unfused)):
        o, vjp = jax.vjp(fn, q, k, v, gq, gk)
        out[name] = (o, *vjp(do))
    return out


@pytest.mark.parametrize("impl,shape,causal", [
    ("pallas", (1, 77, 77, 4, 2, 64), True),
    ("pallas", (2, 40, 100, 2, 1, 128), True),  # Sq < Sk: the queries' positions are the last Sq
    ("xla", (2, 65, 65, 4, 4, 64), False),
])
def test_sage_attention_with_a_prologue_equals_the_unfused_composition(impl, shape, causal):
    """o and the gradients of q, k, v and both norm scales: the fused call = sage_attention on the prologue's
    output with the prologue differentiated by autodiff (to float32 accumulation order and a rare last bit)."""
    b, sq, sk, hq, hkv, d = shape
    q, _, _, do, gq, gk = _inputs(b, sq, hq, hkv, d)
    _, k, v, _, _, _ = _inputs(b, sk, hq, hkv, d, seed=1)
    out = _fused_and_unfused(q, k, v, do, gq, gk, causal=causal, impl=impl)
    for name, got, want in zip(("o", "dq", "dk", "dv", "dgq", "dgk"), out["fused"], out["unfused"]):
        assert got.dtype == want.dtype, name
        assert rel_l1(got, want) < 2e-3, (name, rel_l1(got, want))
    for name, got in zip(("o", "dq", "dk", "dv"), out["fused"]):
        assert bool(jnp.all(jnp.isfinite(got.astype(jnp.float32)))), name


def test_prologue_table_gradients_are_zero_and_norm_only_works():
    q, k, v, do, gq, gk = _inputs(1, 70, 2, 1, 64)
    out = _fused_and_unfused(q, k, v, do, gq, gk, causal=True, impl="xla", rope_on=False)
    for got, want in zip(out["fused"], out["unfused"]):
        assert rel_l1(got, want) < 2e-3
    cos, sin = lb.rope_tables(jnp.arange(70), 64)
    grads = jax.grad(lambda pro: jnp.sum(lb.sage_attention(q, k, v, prologue=pro, implementation="xla")
                                         .astype(jnp.float32)))(lb.QKPrologue(gq, gk, cos, sin, cos, sin))
    assert float(jnp.max(jnp.abs(grads.cos_q))) == 0.0 and float(jnp.max(jnp.abs(grads.sin_k))) == 0.0
    assert grads.q_norm.dtype == gq.dtype and float(jnp.max(jnp.abs(grads.q_norm.astype(jnp.float32)))) > 0


@pytest.mark.parametrize("change,match", [
    (dict(q_norm="wrong"), r"prologue\.q_norm must have shape \(64,\)"),
    (dict(k_norm=None), "both be given or both be None"),
    (dict(cos_q=jnp.zeros((10, 32))), r"prologue\.cos_q must have shape \(40, 32\)"),
    (dict(sin_k=None), "must all be given or all be None"),
    (dict(eps=0.0), "eps must be a finite positive number"),
    (dict(q_norm=None, k_norm=None, cos_q=None, sin_q=None, cos_k=None, sin_k=None), "give a norm"),
])
def test_bad_prologue_is_rejected(change, match):
    q, k, v, _, gq, gk = _inputs(1, 40, 2, 1, 64)
    pro = dataclasses.replace(_prologue(40, 64, gq, gk), **change)
    with pytest.raises(ValueError, match=match):
        lb.sage_attention(q, k, v, prologue=pro, implementation="xla")
    with pytest.raises(TypeError, match="prologue must be a QKPrologue"):
        lb.sage_attention(q, k, v, prologue=(gq, gk), implementation="xla")


@pytest.mark.parametrize("method,loss_tol", [("sage", 1e-4), ("qat_fp4", 1e-3)])
def test_model_with_the_fused_prologue_matches_the_unfused_model(method, loss_tol):
    """The sage and qat_fp4 models hand q and k to their attention before QK-norm and RoPE
    (``fuse_qk_prologue``): same loss to float32 rounding (Attn-QAT: and a rare FP4 rounding flip where a row's
    rsqrt differs in its last bit); gradients within the 16-bit rounding differences of two backward formulas of
    the norm (Flax's autodiff rounds its two terms of dx to bf16 apart), compounded over the layers."""
    cfg = model_config("tiny", method=method, num_layers=2)
    tokens = jax.random.randint(jax.random.key(0), (2, 96), 0, cfg.vocab_size)
    results = {}
    for fuse in (True, False):
        model = TransformerLM(dataclasses.replace(cfg, fuse_qk_prologue=fuse), rngs=nnx.Rngs(0),
                              attention_options=dict(implementation="xla"))
        graph, state = nnx.split(model)
        loss = lambda st: jnp.mean(nnx.merge(graph, st)(tokens).astype(jnp.float32) ** 2)  # noqa: E731,B023
        results[fuse] = jax.value_and_grad(loss)(state)
    (loss_f, grads_f), (loss_u, grads_u) = results[True], results[False]
    assert abs(float(loss_f) - float(loss_u)) < loss_tol * abs(float(loss_u))
    worst = max(rel_l1(a, b) for a, b in zip(jax.tree.leaves(grads_f), jax.tree.leaves(grads_u)))
    assert worst < 5e-2
