"""Attn-QAT with the fused QK-norm + RoPE prologue (``qat_attention(..., prologue=QKPrologue(...))``).

The fake-quantization kernel given the pre-norm q or k and a prologue writes FQ of the prologue's output (as the
same kernel given ``qk_prologue.apply``'s output), and ``qat_attention`` with a prologue equals the unfused
composition — values and gradients, the norm scales' included — for the Pallas kernels (interpreted) and the xla
twin, and with K-smoothing (the model with the fused prologue: tests/test_qk_prologue.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit_jax as lb
from lowbit_jax import rel_l1
from pallas_kernels.numerics import qk_prologue as P
from pallas_kernels import lane_groups
from pallas_kernels.fake_quant import fp4_fake_quant_heads, fp4_fake_quant_kv

EPS = 1e-6


def _inputs(b, sq, sk, hq, hkv, d, dtype=jnp.bfloat16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = (2.0 * jax.random.normal(ks[0], (b, sq, hq, d))).astype(dtype)
    k = (2.0 * jax.random.normal(ks[1], (b, sk, hkv, d)) + 0.5).astype(dtype)
    v = jax.random.normal(ks[2], (b, sk, hkv, d)).astype(dtype)
    do = jax.random.normal(ks[3], (b, sq, hq, d)).astype(dtype)
    g = (1.0 + 0.3 * jax.random.normal(ks[4], (2, d))).astype(dtype)
    return q, k, v, do, g[0], g[1]


def _prologue(sq, sk, d, gq, gk, *, norm=True, rope_on=True):
    """The queries take the last Sq of the Sk positions (a prefill chunk after cached tokens)."""
    cq, sq_ = lb.rope_tables(jnp.arange(sk - sq, sk), d) if rope_on else (None, None)
    ck, sk_ = lb.rope_tables(jnp.arange(sk), d) if rope_on else (None, None)
    return lb.QKPrologue(gq if norm else None, gk if norm else None, cq, sq_, ck, sk_, eps=EPS)


@pytest.mark.parametrize("d,s,norm,rope_on,lanes,dtype", [
    (64, 77, True, True, True, jnp.bfloat16),
    (128, 130, True, False, False, jnp.bfloat16),
    (64, 64, False, True, True, jnp.float16),
    (32, 50, True, True, False, jnp.bfloat16),
])
def test_fake_quant_kernel_with_the_prologue_quantizes_its_output(d, s, norm, rope_on, lanes, dtype):
    """Interpreted: FQ kernel(pre-norm x, prologue) = FQ kernel(``qk_prologue.apply(x)``), ragged lengths and the
    lane order included; an element may differ where a row's rsqrt differs in its last bit (the kernel sums the
    channels in another order than XLA's reduction), so at most a rare one."""
    q, k, _, _, gq, gk = _inputs(2, s, s, 3, 2, d, dtype)
    pro = _prologue(s, s, d, gq, gk, norm=norm, rope_on=rope_on)
    kw = dict(seq_pad=-(-s // 64) * 64, block=64, out_dtype=dtype, lane_order=lanes, interpret=True)
    for x, which in ((q, "q"), (k, "k")):
        got = fp4_fake_quant_heads(x, pro, which, **kw)
        want = fp4_fake_quant_heads(P.apply(x, *pro.side(which), eps=EPS), **kw)
        assert got.shape == want.shape and got.dtype == want.dtype
        differ = np.asarray(got != want)
        assert np.mean(differ) < 1e-3, (which, np.mean(differ))
        in_order = lane_groups.from_lane_order(got, 2) if lanes else got
        assert np.all(np.asarray(in_order[:, :, s:]) == 0)  # padding rows stay zero
    plain = fp4_fake_quant_heads(q, **kw)  # the prologue does change the values
    assert rel_l1(fp4_fake_quant_heads(q, pro, "q", **kw), plain) > 0.05


@pytest.mark.parametrize("d,s,with_prologue,lanes", [(64, 77, True, True), (128, 130, False, False),
                                                     (64, 128, False, True)])
def test_fake_quant_of_k_and_v_in_one_launch(d, s, with_prologue, lanes):
    """Interpreted: ``fp4_fake_quant_kv`` (Attn-QAT's K and V in one launch) gives exactly what one launch each
    gives, the prologue's "k" side applied to k only (ragged lengths, lane order on and off), and refuses a v
    that does not match k."""
    _, k, v, _, gq, gk = _inputs(2, s, s, 3, 2, d)
    pro = _prologue(s, s, d, gq, gk) if with_prologue else None
    kw = dict(seq_pad=-(-s // 64) * 64, block=64, out_dtype=jnp.bfloat16, lane_order=lanes, interpret=True)
    kf, vf = fp4_fake_quant_kv(k, v, pro, **kw)
    np.testing.assert_array_equal(kf, fp4_fake_quant_heads(k, pro, "k", **kw))
    np.testing.assert_array_equal(vf, fp4_fake_quant_heads(v, **kw))
    with pytest.raises(ValueError, match="k and v must match"):
        fp4_fake_quant_kv(k, v[:, :-1], pro, **kw)


def test_fake_quant_kernel_refuses_a_prologue_along_tokens_and_a_bad_side():
    q, _, _, _, gq, gk = _inputs(1, 64, 64, 2, 2, 64)
    kw = dict(seq_pad=64, block=64, out_dtype=jnp.bfloat16, interpret=True)
    with pytest.raises(ValueError, match="along='channels'"):
        fp4_fake_quant_heads(q, _prologue(64, 64, 64, gq, gk), "q", along="tokens", **kw)
    with pytest.raises(ValueError, match="which must be 'q' or 'k'"):
        fp4_fake_quant_heads(q, _prologue(64, 64, 64, gq, gk), "v", **kw)


def _fused_and_unfused(q, k, v, do, pro, **kw):
    def fused(q, k, v, gq, gk):
        return lb.qat_attention(q, k, v, prologue=dataclasses.replace(pro, q_norm=gq, k_norm=gk), **kw)

    def unfused(q, k, v, gq, gk):
        qz = P.apply(q, gq, pro.cos_q, pro.sin_q, eps=EPS)
        kz = P.apply(k, gk, pro.cos_k, pro.sin_k, eps=EPS)
        return lb.qat_attention(qz, kz, v, **kw)

    out = {}
    for name, fn in (("fused", fused), ("unfused", unfused)):
        o, vjp = jax.vjp(fn, q, k, v, pro.q_norm, pro.k_norm)
        out[name] = (o, *vjp(do))
    return out


@pytest.mark.parametrize("impl,shape,causal,extra", [
    ("pallas", (1, 77, 77, 4, 2, 64), True, {}),
    ("pallas", (2, 40, 100, 2, 1, 128), True, {}),  # Sq < Sk: the queries' positions are the last Sq
    ("pallas", (1, 64, 64, 2, 2, 64), False, dict(naive_backward=True)),
    ("xla", (2, 65, 65, 4, 4, 64), False, {}),
    ("xla", (1, 70, 70, 2, 1, 64), True, dict(smooth_k=True)),  # the prologue runs unfused, before smoothing
])
def test_qat_attention_with_a_prologue_equals_the_unfused_composition(impl, shape, causal, extra):
    """o and the gradients of q, k, v and both norm scales: the fused call = qat_attention on the prologue's
    output with the prologue differentiated by autodiff (to float32 accumulation order and a rare FP4 rounding
    flip where a row's rsqrt differs in its last bit)."""
    b, sq, sk, hq, hkv, d = shape
    q, _, _, do, gq, gk = _inputs(b, sq, sq, hq, hkv, d)
    _, k, v, _, _, _ = _inputs(b, sk, sk, hq, hkv, d, seed=1)
    pro = _prologue(sq, sk, d, gq, gk)
    out = _fused_and_unfused(q, k, v, do, pro, causal=causal, implementation=impl, interpret=impl == "pallas",
                             **extra)
    for name, got, want in zip(("o", "dq", "dk", "dv", "dgq", "dgk"), out["fused"], out["unfused"]):
        assert got.dtype == want.dtype, name
        assert rel_l1(got, want) < 5e-3, (name, rel_l1(got, want))
        assert bool(jnp.all(jnp.isfinite(got.astype(jnp.float32)))), name
    # and the prologue matters: without it the output is another one
    assert rel_l1(out["fused"][0], lb.qat_attention(q, k, v, causal=causal, implementation=impl,
                                                    interpret=impl == "pallas", **extra)) > 0.05


def test_qat_prologue_table_gradients_are_zero_and_rope_only_works():
    q, k, v, do, gq, gk = _inputs(1, 70, 70, 2, 1, 64)
    pro = _prologue(70, 70, 64, gq, gk, norm=False)
    kw = dict(causal=True, implementation="xla")
    o = lb.qat_attention(q, k, v, prologue=pro, **kw)
    want = lb.qat_attention(P.apply(q, None, pro.cos_q, pro.sin_q, eps=EPS),
                            P.apply(k, None, pro.cos_k, pro.sin_k, eps=EPS), v, **kw)
    assert rel_l1(o, want) < 1e-3
    grads = jax.grad(lambda pro: jnp.sum(lb.qat_attention(q, k, v, prologue=pro, **kw).astype(jnp.float32)))(
        _prologue(70, 70, 64, gq, gk))
    assert float(jnp.max(jnp.abs(grads.cos_q))) == 0.0 and float(jnp.max(jnp.abs(grads.sin_k))) == 0.0
    assert grads.k_norm.dtype == gk.dtype and float(jnp.max(jnp.abs(grads.k_norm.astype(jnp.float32)))) > 0


@pytest.mark.parametrize("change,match", [
    (dict(k_norm=None), "both be given or both be None"),
    (dict(cos_k=jnp.zeros((10, 32))), r"prologue\.cos_k must have shape \(40, 32\)"),
])
def test_bad_qat_prologue_is_rejected(change, match):
    q, k, v, _, gq, gk = _inputs(1, 40, 40, 2, 1, 64)
    pro = dataclasses.replace(_prologue(40, 40, 64, gq, gk), **change)
    with pytest.raises(ValueError, match=match):
        lb.qat_attention(q, k, v, prologue=pro, implementation="xla")
    with pytest.raises(TypeError, match="prologue must be a QKPrologue"):
        lb.qat_attention(q, k, v, prologue=(gq, gk), implementation="xla")

