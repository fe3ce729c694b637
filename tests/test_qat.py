"""Attn-QAT: kernels (interpret on CPU) ↔ xla twin ↔ autodiff of the STE graph ↔ exact attention."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit_jax as lb
from attention_base import (INTERPRET, AttentionTestBase, cotangent, make_qkv, metrics, shard_map_grads,
                            trace_stage_waits, vjp_outputs)
from pallas_kernels.numerics import nvfp4
from lowbit_jax.qat_reference import qat_attention_ste

SMALL = lb.QatConfig(block_q=32, block_k=32, bwd_block_q=32, bwd_block_k=32, quant_block=32)


def grads(q, k, v, do, **options):
    """(o, dq, dk, dv) of qat_attention."""
    options.setdefault("config", SMALL)
    return vjp_outputs(functools.partial(lb.qat_attention, **options), q, k, v, do)


class QatXla(AttentionTestBase):
    implementation = "xla"
    min_cos = 0.98  # FP4: the paper's ≈ 0.98 kernel accuracy
    max_rel_l1 = 0.2

    def run(self, q, k, v, **options):
        options.setdefault("config", SMALL)
        return lb.qat_attention(q, k, v, implementation=self.implementation, interpret=self.interpret, **options)


class TestQatXla(QatXla):
    @pytest.mark.parametrize("case", AttentionTestBase.AWKWARD_CASES)
    def test_close_to_exact(self, case):
        self.check_awkward_case(case)

    def test_empty_rows_are_zero(self):
        q, k, v = make_qkv(1, 80, 30, 2, 2, 64, seed=7)
        out = self.run(q, k, v, causal=True)
        np.testing.assert_array_equal(np.asarray(out[:, :50], np.float32), 0.0)
        assert np.all(np.abs(np.asarray(out[:, 50:], np.float32)).sum(-1) > 0)


class TestQatPallas(TestQatXla):
    implementation = "pallas"


@pytest.mark.parametrize("case", AttentionTestBase.AWKWARD_CASES[:3])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_kernel_matches_xla_forward_and_gradients(case, dtype):
    b, sq, sk, hq, hkv, d, causal = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=dtype, seed=sq + sk)
    do = cotangent(q)
    g_p = grads(q, k, v, do, causal=causal, implementation="pallas", interpret=INTERPRET)
    g_x = grads(q, k, v, do, causal=causal, implementation="xla")
    for name, a, r in zip(("o", "dq", "dk", "dv"), g_p, g_x):
        assert a.dtype == dtype and a.shape == r.shape
        _, rel = metrics(a, r)
        assert rel < 2e-3, (name, rel)  # same quantization; differences are accumulation order / 16-bit rounding


MOSAIC = lb.QatConfig(fwd_backend="mosaic", bwd_backend="mosaic")
MOSAIC_CASES = [  # (B, Sq, Sk, Hq, Hkv, D, causal, naive, dtype): Sq ≤ Sk when causal (else Triton runs)
    (1, 128, 128, 2, 2, 64, False, False, jnp.bfloat16),
    (1, 100, 250, 4, 1, 128, True, False, jnp.float16),  # ragged Sq and Sk, MQA, chunked-prefill causal
    (1, 200, 200, 4, 2, 64, True, True, jnp.bfloat16),  # ragged, GQA, two 128-row CTAs; the naive backward
    (1, 192, 192, 2, 1, 128, False, False, jnp.bfloat16),  # a fully padded key tile (Sk_pad 256)
]


@pytest.mark.parametrize("case", MOSAIC_CASES)
def test_mosaic_kernels_match_xla(case, monkeypatch):
    """fwd_backend = bwd_backend = "mosaic" (Mosaic GPU interpreter on the CPU): O and the gradients equal
    the xla twin's up to accumulation order (the Triton kernels are held to the same twin by the base tests)."""
    from pallas_kernels import qat_bwd_mosaic, qat_fwd_mosaic

    calls = []
    for mod, name in ((qat_fwd_mosaic, "qat_attention_fwd_mosaic"), (qat_bwd_mosaic, "qat_attention_bwd_mosaic")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    b, sq, sk, hq, hkv, d, causal, naive, dtype = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=dtype, seed=sq + d)
    do = cotangent(q)
    opts = dict(causal=causal, naive_backward=naive)
    g_m = grads(q, k, v, do, implementation="pallas", interpret=True, config=MOSAIC, **opts)
    assert sorted(set(calls)) == ["qat_attention_bwd_mosaic", "qat_attention_fwd_mosaic"], calls
    g_x = grads(q, k, v, do, implementation="xla", config=lb.QatConfig(), **opts)
    for name, a, x in zip(("o", "dq", "dk", "dv"), g_m, g_x):
        assert a.shape == x.shape and a.dtype == x.dtype == dtype
        assert metrics(a, x)[1] < 2e-3, name
    o_only = lb.qat_attention(q, k, v, causal=causal, implementation="pallas", interpret=True, config=MOSAIC)
    np.testing.assert_array_equal(np.asarray(o_only, np.float32), np.asarray(g_m[0], np.float32))


def test_hopper_configs_take_128_key_forward_tiles():
    """On the H200 and the H100 Attn-QAT resolves 128-key forward tiles (``configs.TUNED_QAT``: the Mosaic forward
    5–13% faster); elsewhere :class:`QatConfig`'s 64."""
    for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        assert [lb.qat_config(d, c, kind).block_k for d in (64, 128) for c in (False, True)] == [128] * 4, kind
    assert lb.qat_config(128, False, "cpu").block_k == lb.QatConfig().block_k == 64


@pytest.mark.parametrize("case", [(1, 200, 300, 4, 2, 128, True), (1, 256, 256, 2, 2, 64, False)])
def test_mosaic_h200_config_matches_xla(case):
    """The H200's config (128-key forward steps) on the Mosaic kernels (interpreted) equals the xla twin with the
    same config, causal with ragged Sq < Sk and GQA, and non-causal at D64; its O differs from 64-key tiles' (P̃
    is relative to each tile's running max), so the tile is in effect."""
    b, sq, sk, hq, hkv, d, causal = case
    cfg = dataclasses.replace(lb.qat_config(d, causal, "NVIDIA H200"), fwd_backend="mosaic", bwd_backend="mosaic")
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=jnp.bfloat16, seed=sq + sk + d)
    do = cotangent(q)
    g_m = grads(q, k, v, do, causal=causal, implementation="pallas", interpret=True, config=cfg)
    g_x = grads(q, k, v, do, causal=causal, implementation="xla", config=cfg)
    for name, a, x in zip(("o", "dq", "dk", "dv"), g_m, g_x):
        assert metrics(a, x)[1] < 2e-3, (name, metrics(a, x))
    o64 = lb.qat_attention(q, k, v, causal=causal, implementation="xla", config=lb.QatConfig())
    assert metrics(o64, g_x[0])[1] > 5e-3  # 2e-2 rel-L1 on these inputs


@pytest.mark.parametrize("causal", [False, True])
def test_mosaic_forward_pingpong_same_values(monkeypatch, causal):
    """QatConfig(pingpong=True): the Mosaic forward's schedule barrier (interpreter, two query blocks, ragged
    Sq, GQA; causal with Sq < Sk, where the CTAs' pipelines differ in length) orders the warpgroups only — O, O',
    the LSE and m equal the unscheduled kernel's, and O the xla twin's. A spy checks that the kernel was built
    with the schedule on, then off. (Interpreted causal calls used to skip the schedule: the interpreter's
    warpgroup threads could starve with four host devices; tests/conftest.py now forces eight.)"""
    from lowbit_jax import qat as qat_mod
    from pallas_kernels import qat_fwd_mosaic

    kernel, built = qat_fwd_mosaic._fwd_kernel, []
    monkeypatch.setattr(qat_fwd_mosaic, "_fwd_kernel",
                        lambda *a, **kw: built.append(kw["p"].pingpong) or kernel(*a, **kw))
    q, k, v = make_qkv(1, 200, 256, 4, 2, 64, dtype=jnp.bfloat16, seed=31)
    outs = []
    for pingpong in (True, False):
        jax.clear_caches()
        cfg = lb.QatConfig(fwd_backend="mosaic", bwd_backend="mosaic", pingpong=pingpong)
        opts = qat_mod.resolve_qat_options(q, k, v, causal=causal, naive_backward=False, implementation="pallas",
                                           interpret=True, config=cfg)
        outs.append(qat_mod.qat_forward(q, k, v, opts=opts, with_aux=True)[:4])
    assert built[0] is True and built[-1] is False and set(built) == {True, False}
    for name, a, r in zip(("o", "o_aux", "lse", "m"), *outs):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(r, np.float32), err_msg=name)
    x = lb.qat_attention(q, k, v, causal=causal, implementation="xla", config=lb.QatConfig())
    assert metrics(outs[0][0], x)[1] < 2e-3


@pytest.mark.parametrize("case", [(1, 130, 200, 4, 2, 64, True), (1, 128, 256, 2, 1, 128, True)])
def test_mosaic_fused_dq_same_gradients(case):
    """QatConfig.dq_kernel="fused" (dS·K̃ reduce-added into a float32 dQ by the dK/dV kernel; in the
    interpreter a per-block workspace, summed) gives the separate dQ kernel's gradients (ragged Sq,
    GQA and MQA, D64 and D128, causal with Sq < Sk: where it is the default); dK and dV come from the same
    kernel body either way. At D128
    the fused dQ is split by columns between the warpgroups (each reads the other's dS tile after a
    CTA-wide barrier): a wrong tile, parity or column half changes dQ here."""
    b, sq, sk, hq, hkv, d, causal = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=jnp.bfloat16, seed=sq + d)
    do = cotangent(q)
    got = {mode: grads(q, k, v, do, causal=causal, implementation="pallas", interpret=True,
                       config=dataclasses.replace(MOSAIC, dq_kernel=mode)) for mode in ("fused", "separate")}
    for name, a, r in zip(("o", "dq", "dk", "dv"), got["fused"], got["separate"]):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        assert metrics(a, r)[1] < 1e-5, (name, metrics(a, r))  # float32 sums in another order, then bf16
    from pallas_kernels import qat_bwd_mosaic

    cfg = lb.QatConfig()
    assert all(cfg.fuses_dq(d, causal) for d in (64, 128) for causal in (False, True))
    assert lb.QatConfig(dq_kernel="fused").fuses_dq(128, False)
    assert not lb.QatConfig(dq_kernel="separate").fuses_dq(64, True)
    assert qat_bwd_mosaic.splits_dq_columns(128) and not qat_bwd_mosaic.splits_dq_columns(64)


@pytest.mark.parametrize("d, causal", [(128, False), (64, True), (64, False), (128, True)])
def test_mosaic_dq_stage_protocol(monkeypatch, d, causal):
    """One ``reduce_add.stage_free`` (all earlier TMA reduce-adds have read the dQ stage) before each reduce-add of
    the fused dQ. Where the dQ product goes first (``dq_first``) it is the products' ``issued`` hook, so it runs
    while they are on the tensor cores; otherwise it stays inside ``reduce_add_out``. Checked on the traced kernel:
    the interpreter's copies are synchronous, so its values cannot show a missing wait."""
    from pallas_kernels import qat_bwd_mosaic

    q, k, v = make_qkv(1, 128, 128, 2, 1, d, dtype=jnp.bfloat16, seed=d)
    fn = functools.partial(lb.qat_attention, causal=causal, config=dataclasses.replace(MOSAIC, dq_kernel="fused"),
                           implementation="pallas", interpret=True)
    events = trace_stage_waits(monkeypatch, qat_bwd_mosaic, fn, q, k, v)
    assert events == [("free", 0), ("out", qat_bwd_mosaic.dq_first(d, causal))], events


def test_mosaic_coverage():
    from pallas_kernels import qat_bwd_mosaic, qat_fwd_mosaic

    ok = dict(sq_len=256, sk_len=256, sq_pad=256, head_dim=128, causal=True, out_dtype=jnp.bfloat16, config=MOSAIC)
    assert qat_fwd_mosaic.supports(**ok)
    for change in (dict(head_dim=32), dict(sq_pad=192), dict(out_dtype=jnp.float32), dict(sq_len=300, sq_pad=384),
                   dict(config=lb.QatConfig(block_k=32, fwd_backend="mosaic"))):
        assert not qat_fwd_mosaic.supports(**{**ok, **change}), change
    ok = dict(sq_len=256, sk_len=256, sq_pad=256, sk_pad=256, head_dim=64, causal=True, dtype=jnp.float16,
              do_dtype=jnp.float16)
    assert qat_bwd_mosaic.supports(**ok)
    for change in (dict(head_dim=32), dict(sk_pad=192), dict(sq_pad=320), dict(do_dtype=jnp.float32),
                   dict(dtype=jnp.float32, do_dtype=jnp.float32), dict(sq_len=300, sq_pad=384)):
        assert not qat_bwd_mosaic.supports(**{**ok, **change}), change
    triton = lb.QatConfig(fwd_backend="triton", bwd_backend="triton")
    assert MOSAIC.pad == 128 and lb.QatConfig(bwd_backend="mosaic").pad == 128 and triton.pad == 64
    # "auto" (the default): Mosaic on a compiled Hopper call, Triton elsewhere (the CPU included)
    assert lb.QatConfig().with_backends(True) == MOSAIC and lb.QatConfig().with_backends(False) == triton
    assert lb.QatConfig().with_backends(False).pad == 64
    opts = lb.qat.resolve_qat_options(*(jnp.ones((1, 64, 2, 64), jnp.bfloat16),) * 3, implementation="pallas",
                                      interpret=True)
    assert (opts.config.fwd_backend, opts.config.bwd_backend) == ("triton", "triton")
    for name in ("fwd_backend", "bwd_backend"):
        with pytest.raises(ValueError, match=f"{name} must be one of"):
            lb.QatConfig(**{name: "cuda"})


def test_float32_inputs_and_naive_backward_kernel():
    q, k, v = make_qkv(1, 64, 96, 2, 1, 128, dtype=jnp.float32, seed=3)
    do = cotangent(q)
    for naive in (False, True):
        g_p = grads(q, k, v, do, naive_backward=naive, implementation="pallas", interpret=INTERPRET)
        g_x = grads(q, k, v, do, naive_backward=naive, implementation="xla")
        for a, r in zip(g_p, g_x):
            assert a.dtype == jnp.float32
            assert metrics(a, r)[1] < 2e-3


def test_forward_semantics_single_tile():
    """With one key tile, O = FQ(exp2(S − rowmax))·Ṽ / l (l from the unquantized P), O' alone is not returned; the
    operands are bf16 for float32 inputs, so FQ(P) is the bf16 quantizer (:func:`nvfp4.fake_quant_probabilities`),
    whose values differ from the float32 quantizer's measurably."""
    q, k, v = make_qkv(1, 32, 64, 1, 1, 64, dtype=jnp.float32, seed=4)
    cfg = lb.QatConfig(block_q=32, block_k=64, bwd_block_q=32, bwd_block_k=64, quant_block=32)
    out = lb.qat_attention(q, k, v, implementation="xla", config=cfg)
    qt, kt, vt = (np.asarray(nvfp4.fake_quant_last(x[0, :, 0]), np.float64) for x in (q, k, v))
    s = qt @ kt.T * (64**-0.5) * np.log2(np.e)
    e = np.exp2(s - s.max(-1, keepdims=True))
    eq = np.asarray(nvfp4.fake_quant_probabilities(jnp.asarray(e, jnp.float32), jnp.bfloat16), np.float64)
    want = (eq @ vt) / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(out[0, :, 0]), want, rtol=2e-2, atol=2e-2)  # bf16 MMA operands
    assert metrics(out[0, :, 0], want)[1] < 4e-3
    eq32 = np.asarray(nvfp4.fake_quant_last(jnp.asarray(e, jnp.float32), nonnegative=True), np.float64)
    assert 0 < np.mean(eq != eq32) < 0.05  # another quantizer: a few groups' scales and near-midpoint values
    # and FP4 matters: the unquantized P gives a measurably different output
    assert metrics((e @ vt) / e.sum(-1, keepdims=True), want)[1] > 0.02


@pytest.mark.parametrize("causal", [False, True])
def test_backward_is_autodiff_of_the_ste_graph(causal):
    """dV = FQ(P)ᵀdO, dP = dO·Ṽᵀ, D from O' — the autodiff of P + sg(FQ(P) − P) with STE quantizers."""
    q, k, v = make_qkv(1, 96, 80, 2, 1, 64, dtype=jnp.float32, seed=8)
    do = cotangent(q)
    ste = vjp_outputs(functools.partial(qat_attention_ste, causal=causal), q, k, v, do, f32=True)
    ours = grads(q, k, v, do, causal=causal, implementation="xla")
    naive = grads(q, k, v, do, causal=causal, implementation="xla", naive_backward=True)
    for i in (1, 2, 3):
        rel = metrics(ours[i], ste[i])[1]
        assert rel < 6e-3, (i, rel)  # bf16 operands of dS, dO in the products
        assert metrics(naive[i], ste[i])[1] > 2.5 * rel  # the mismatched backward is measurably different


def test_naive_backward_is_the_16bit_flash_backward():
    """naive: P from Q̃K̃ᵀ, dV = PᵀdO, D = rowsum(dO ∘ O) with the FP4 output O."""
    q, k, v = make_qkv(1, 64, 64, 1, 1, 64, dtype=jnp.float32, seed=9)
    do = cotangent(q)
    o, dq, dk, dv = grads(q, k, v, do, implementation="xla", naive_backward=True)
    qt, kt, vt = (np.asarray(nvfp4.fake_quant_last(x[0, :, 0]), np.float64) for x in (q, k, v))
    dO, O = np.asarray(do[0, :, 0], np.float64), np.asarray(o[0, :, 0], np.float64)
    sc = 64**-0.5
    s = qt @ kt.T * sc
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ds = p * (dO @ vt.T - (dO * O).sum(-1, keepdims=True))
    for got, want in ((dv, p.T @ dO), (dq, ds @ kt * sc), (dk, ds.T @ qt * sc)):
        assert metrics(got[0, :, 0], want)[1] < 6e-3


@pytest.mark.parametrize("seq", [256, 4096])
def test_gradients_close_to_exact_attention(seq):
    """Long rows too: the normalized P of a 4096-key row lies below e4m3's smallest group scale."""
    q, k, v = make_qkv(1, seq, seq, 1, 1, 64, seed=10)
    do = cotangent(q)
    exact = vjp_outputs(lb.reference_attention, q, k, v, do, f32=True)
    ours = grads(q, k, v, do, implementation="xla")
    for i, name in enumerate(("o", "dq", "dk", "dv")):
        cos, _ = metrics(ours[i], exact[i])
        assert cos >= 0.97, (name, cos)  # ≈ 0.98 in the paper; measured at S=4096 by benchmarks/qat.py


def test_primal_without_grad_equals_forward_of_vjp():
    q, k, v = make_qkv(1, 40, 50, 2, 2, 64, seed=11)
    for impl in ("xla", "pallas"):
        f = functools.partial(lb.qat_attention, causal=True, implementation=impl, interpret=INTERPRET, config=SMALL)
        o_vjp, _ = jax.vjp(f, q, k, v)
        np.testing.assert_array_equal(np.asarray(jax.jit(f)(q, k, v), np.float32), np.asarray(o_vjp, np.float32))


def test_fully_masked_rows_have_finite_zero_gradients():
    q, k, v = make_qkv(1, 80, 30, 2, 2, 64, seed=5)
    do = cotangent(q)
    for impl in ("xla", "pallas"):
        out = grads(q, k, v, do, causal=True, implementation=impl, interpret=INTERPRET)
        for g in out:
            assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))
        np.testing.assert_array_equal(np.asarray(out[1][:, :50], np.float32), 0.0)


def test_grad_under_jit_and_vmap():
    q, k, v = make_qkv(1, 48, 40, 2, 1, 64, seed=6)
    f = functools.partial(lb.qat_attention, causal=True, implementation="xla", config=SMALL)
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
    eager = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    batched = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(*[jnp.stack([x, x * 0.5]) for x in (q, k, v)])
    for e, j, bt in zip(eager, jitted, batched):
        # XLA may keep f32 where the eager graph rounds dS/P to bf16 (excess precision): bf16-level agreement
        assert metrics(j, e)[1] < 5e-3
        assert metrics(bt[0], e)[1] < 5e-3
        assert float(jnp.max(jnp.abs(bt[1].astype(jnp.float32)))) > 0


@pytest.mark.parametrize("args, kwargs, err, match", [
    ((jnp.zeros((2, 8, 64)),) * 3, {}, ValueError, "rank 4"),
    ((jnp.zeros((1, 8, 3, 64)), jnp.zeros((1, 8, 2, 64)), jnp.zeros((1, 8, 2, 64))), {}, ValueError, "multiple"),
    ((jnp.zeros((1, 8, 2, 48)),) * 3, {}, ValueError, "head_dim"),
    ((jnp.zeros((1, 8, 2, 64), jnp.int8),) * 3, {}, TypeError, "bfloat16"),
    ((jnp.zeros((1, 8, 2, 64)),) * 3, {"naive_backward": "yes"}, TypeError, "naive_backward"),
    ((jnp.zeros((1, 8, 2, 64)),) * 3, {"config": lb.SageFwdConfig()}, TypeError, "QatConfig"),
    ((jnp.zeros((1, 8, 2, 64)),) * 3, {"implementation": "triton"}, ValueError, "implementation"),
])
def test_bad_input(args, kwargs, err, match):
    with pytest.raises(err, match=match):
        lb.qat_attention(*args, **kwargs)


def test_bad_config():
    with pytest.raises(ValueError, match="block_k"):
        lb.QatConfig(block_k=16)
    with pytest.raises(ValueError, match="power of two"):
        lb.QatConfig(block_q=48)
    with pytest.raises(TypeError, match="pingpong"):
        lb.QatConfig(pingpong=1)
    with pytest.raises(ValueError, match="dq_kernel"):
        lb.QatConfig(dq_kernel="atomic")


def test_error_report_for_qat():
    q, k, v = make_qkv(1, 96, 80, 2, 1, 64, seed=12)
    do = cotangent(q)
    rep = lb.diagnostics.attention_error_report(q, k, v, do, method="qat", causal=True, print_table=False,
                                                config=SMALL)
    assert list(rep) == ["O", "D", "P", "dP", "dS", "dQ", "dK", "dV"]
    for name, m in rep.items():
        assert 0.95 <= m["cos_sim"] <= 1.0 + 1e-6, name
        assert 0.0 < m["rel_l2"] < 0.35, name  # FP4: far from exact, never exactly equal
    assert rep["O"]["rel_l2"] > 0.05  # the forward really is 4-bit
    naive = lb.diagnostics.attention_error_report(q, k, v, do, method="qat", causal=True, print_table=False,
                                                  config=SMALL, naive_backward=True)
    assert naive["D"]["rel_l2"] > rep["D"]["rel_l2"]  # D from the FP4 output O instead of O'


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_grad_inside_shard_map_matches_single_device(impl):
    q, k, v = make_qkv(4, 40, 40, 2, 2, 64, seed=7)
    f = functools.partial(lb.qat_attention, causal=True, implementation=impl, interpret=INTERPRET, config=SMALL)
    out, ref = shard_map_grads(f, q, k, v)
    for a, r in zip(out, ref):
        assert metrics(a, r)[1] < 5e-3


def test_k_smoothing_rescues_k_outliers():
    """K with a per-channel mean 8× its std: FP4 K groups lose everything but the mean; smoothing fixes it."""
    q, k, v = make_qkv(1, 256, 256, 2, 1, 64, k_outlier=8.0, seed=13)
    ref = np.asarray(lb.reference_attention(q, k, v), np.float64)
    cos_off, _ = metrics(lb.qat_attention(q, k, v, implementation="xla", config=SMALL), ref)
    cos_on, _ = metrics(lb.qat_attention(q, k, v, implementation="xla", config=SMALL, smooth_k=True), ref)
    assert cos_on >= 0.97 and cos_off < cos_on - 0.05, (cos_on, cos_off)
    do = cotangent(q)
    g_p = grads(q, k, v, do, smooth_k=True, implementation="pallas", interpret=INTERPRET)
    g_x = grads(q, k, v, do, smooth_k=True, implementation="xla")
    for a, r in zip(g_p, g_x):
        assert metrics(a, r)[1] < 2e-3
    # the token mean of dK is projected out (attention's exact dK has none)
    dk_mean = np.abs(np.asarray(g_x[2], np.float32).mean(axis=1)).max()
    assert dk_mean < 1e-2 * np.abs(np.asarray(g_x[2], np.float32)).mean()


def test_lane_order_groups_are_whole_fp4_groups():
    """pallas_kernels.lane_groups: the key order of the Mosaic kernels. The reorder is a permutation of each
    64-key block and its inverse; ``key_of_column`` names the key each column holds; the 16 columns one
    thread holds of a row (8j + 2t + e) are exactly the 16 consecutive keys 16t…16t+15, so ``group_max`` in
    lane order equals the maximum of each natural 16-key group; the operand pass writes K̃ in lane order."""
    from pallas_kernels import lane_groups
    from pallas_kernels.fake_quant import fp4_fake_quant_heads

    keys = jnp.arange(192, dtype=jnp.int32)
    lanes = lane_groups.to_lane_order(keys, 0)
    assert sorted(np.asarray(lanes).tolist()) == list(range(192)) and not np.array_equal(lanes, keys)
    np.testing.assert_array_equal(lane_groups.from_lane_order(lanes, 0), keys)
    np.testing.assert_array_equal(lane_groups.key_of_column(keys), lanes)  # column c holds key_of_column(c)
    np.testing.assert_array_equal(lane_groups.column_of_key(lanes), keys)  # and key k sits at column_of_key(k)
    cols = np.arange(64)
    thread = (cols % 8) // 2  # the lane of the quad holding column c of a WGMMA accumulator row
    for t in range(4):
        assert sorted(np.asarray(lanes)[:64][thread == t].tolist()) == list(range(16 * t, 16 * t + 16))

    p = jax.random.uniform(jax.random.key(0), (64, 128), jnp.float32)
    natural = np.asarray(p).reshape(64, 8, 16).max(-1)  # per row and 16-key group
    got = lane_groups.group_max(lane_groups.to_lane_order(p, 1), interpret=True)
    np.testing.assert_array_equal(lane_groups.from_lane_order(got, 1), np.repeat(natural, 16, axis=1))
    fq = lane_groups.from_lane_order(lane_groups.fake_quant_p(lane_groups.to_lane_order(p, 1), True), 1)
    np.testing.assert_array_equal(fq, nvfp4.fake_quant_last(p, nonnegative=True))
    # the kernels' P̃ for 16-bit operands (bf16: bf16 arithmetic) and P̃·(1/l), against the references' quantizer
    inv_l = jax.random.uniform(jax.random.key(1), (64, 1), jnp.float32, 1e-3, 1.0)
    for dtype in (jnp.bfloat16, jnp.float16):
        for times in (None, inv_l):
            lanes_t = None if times is None else jnp.broadcast_to(times, p.shape)
            got = lane_groups.fake_quant_p(lane_groups.to_lane_order(p, 1), True, times=lanes_t, dtype=dtype)
            assert got.dtype == dtype
            want = nvfp4.fake_quant_probabilities(p, dtype, times=times).astype(dtype)
            np.testing.assert_array_equal(lane_groups.from_lane_order(got, 1), want)
    with pytest.raises(ValueError, match="multiple of 64"):
        lane_groups.group_max(p[:, :96], interpret=True)

    _, k, _ = make_qkv(2, 8, 90, 2, 2, 64, seed=5)
    kw = dict(seq_pad=128, out_dtype=jnp.bfloat16, interpret=INTERPRET)
    plain = fp4_fake_quant_heads(k, block=32, **kw)
    np.testing.assert_array_equal(fp4_fake_quant_heads(k, block=64, lane_order=True, **kw),
                                  lane_groups.to_lane_order(plain, 2))
    with pytest.raises(ValueError, match="lane_order"):
        fp4_fake_quant_heads(k, block=32, lane_order=True, **kw)


@pytest.mark.parametrize("backends", [("mosaic", "triton"), ("triton", "mosaic")])
def test_mixed_backends_match_xla(backends):
    """The Mosaic forward leaves K̃, Ṽ in lane order for the backward; a Triton backward gets them back in key
    order, and a Mosaic backward after a Triton forward reorders them itself (ragged, causal, GQA)."""
    fwd, bwd = backends
    q, k, v = make_qkv(1, 130, 200, 4, 2, 64, dtype=jnp.bfloat16, seed=17)
    do = cotangent(q)
    cfg = lb.QatConfig(fwd_backend=fwd, bwd_backend=bwd)
    got = grads(q, k, v, do, causal=True, implementation="pallas", interpret=True, config=cfg)
    ref = grads(q, k, v, do, causal=True, implementation="xla", config=lb.QatConfig())
    for name, a, x in zip(("o", "dq", "dk", "dv"), got, ref):
        assert metrics(a, x)[1] < 2e-3, name


def test_mosaic_forward_warpgroups_per_call():
    """qat_fwd_mosaic.compute_wgs: three compute warpgroups only for the O-only forward (no O′) at head dim 64,
    non-causal (the training forward and causal calls measured slower with three on the H200); two elsewhere."""
    from pallas_kernels import qat_fwd_mosaic

    assert qat_fwd_mosaic.compute_wgs(64, causal=False, with_aux=False) == 3
    assert qat_fwd_mosaic.compute_wgs(64, causal=True, with_aux=False) == 2
    assert qat_fwd_mosaic.compute_wgs(64, causal=False, with_aux=True) == 2
    assert qat_fwd_mosaic.compute_wgs(128, causal=False, with_aux=False) == 2


@pytest.mark.parametrize("sq, sk", [(384, 384), (250, 300)])
def test_mosaic_o_only_forward_on_three_warpgroups_equals_the_training_forward(monkeypatch, sq, sk):
    """The O-only forward (not differentiated) at head dim 64, non-causal, runs three compute warpgroups per CTA
    (``compute_wgs``) and skips the key tiles that are nothing to a warpgroup; each row's arithmetic is that of the
    two-warpgroup training forward, so O, the LSE and m must be equal exactly (interpreter; Sq 250 leaves the second
    CTA partly past the padded rows; GQA). A spy checks the warpgroup counts."""
    from lowbit_jax import qat as qat_mod
    from pallas_kernels import qat_fwd_mosaic

    q, k, v = make_qkv(1, sq, sk, 4, 2, 64, dtype=jnp.bfloat16, seed=sq + 5)
    launch, counts = qat_fwd_mosaic.launch, []
    monkeypatch.setattr(qat_fwd_mosaic, "launch", lambda *a, **kw: counts.append(kw["compute_wgs"]) or launch(*a, **kw))
    cfg = lb.QatConfig(fwd_backend="mosaic", bwd_backend="mosaic")
    opts = qat_mod.resolve_qat_options(q, k, v, causal=False, naive_backward=False, implementation="pallas",
                                       interpret=True, config=cfg)
    outs = {aux: [np.asarray(x, np.float32) for i, x in enumerate(qat_mod.qat_forward(q, k, v, opts=opts,
                                                                                        with_aux=aux)[:4]) if i != 1]
            for aux in (False, True)}
    assert counts == [3, 2]
    for name, a, r in zip(("o", "lse", "m"), outs[False], outs[True]):
        np.testing.assert_array_equal(a, r, err_msg=name)
    x = lb.qat_attention(q, k, v, implementation="xla", config=lb.QatConfig())
    assert metrics(outs[False][0], x)[1] < 2e-3
