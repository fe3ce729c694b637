"""SageBwd: gradients of sage_attention — kernels (interpret on CPU) ↔ xla backward ↔ exact autodiff."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit_jax as lb
from attention_base import (INTERPRET, cotangent, make_qkv, metrics, shard_map_grads, trace_stage_waits,
                            vjp_outputs)
from lowbit_jax import sage as sage_mod
from lowbit_jax.sage_reference import sage_backward_reference

SMALL = lb.SageFwdConfig(block_q=32, block_k=32)


def grads(q, k, v, do, **options):
    """(o, dq, dk, dv) of sage_attention."""
    options.setdefault("config", SMALL)
    return vjp_outputs(functools.partial(lb.sage_attention, **options), q, k, v, do)


def exact_grads(q, k, v, do, causal):
    return vjp_outputs(functools.partial(lb.reference_attention, causal=causal), q, k, v, do, f32=True)


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, causal, dtype, granularity, smooth_q, config)
    (1, 100, 77, 4, 2, 64, True, jnp.bfloat16, "per_block", False, SMALL),
    (2, 64, 64, 2, 2, 128, False, jnp.float16, "per_block", False, SMALL),
    (1, 70, 130, 2, 1, 64, False, jnp.float32, "per_token", True, SMALL),
    (1, 90, 150, 4, 2, 64, True, jnp.bfloat16, "per_block", True, lb.SageFwdConfig(64, 64, bwd_block_q=16)),
    # the dQ kernel on wider key tiles than the dK/dV kernel (dS tiles differ per product)
    (1, 100, 150, 4, 2, 64, True, jnp.bfloat16, "per_block", False,
     lb.SageFwdConfig(32, 64, bwd_block_q=32, bwd_block_k=32, dq_block_k=64)),
    (1, 70, 130, 2, 1, 128, False, jnp.float32, "per_token", False,
     lb.SageFwdConfig(32, 64, bwd_block_q=32, bwd_block_k=32, dq_block_k=64)),
]


@pytest.mark.parametrize("case", CASES)
def test_kernel_gradients_match_xla_backward(case):
    b, sq, sk, hq, hkv, d, causal, dtype, gran, smooth_q, cfg = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=dtype, seed=sq + sk, k_outlier=3.0)
    do = cotangent(q)
    kw = dict(causal=causal, qk_granularity=gran, smooth_q=smooth_q, config=cfg)
    g_p = grads(q, k, v, do, implementation="pallas", interpret=INTERPRET, **kw)
    g_x = grads(q, k, v, do, implementation="xla", **kw)
    g_e = exact_grads(q, k, v, do, causal)
    for name, a, x, e in zip(("o", "dq", "dk", "dv"), g_p, g_x, g_e):
        assert a.dtype == dtype and a.shape == x.shape
        cos, rel = metrics(a, x)
        assert rel <= 1e-3 and cos >= 0.99999, (name, cos, rel)  # same quantization: accumulation order only
        for impl, out in (("pallas", a), ("xla", x)):
            cos, rel = metrics(out, e)
            assert cos >= (0.998 if name in ("o", "dv") else 0.995), (impl, name, cos)
            assert rel <= 0.06, (impl, name, rel)


def test_xla_gradient_is_sagebwd_not_autodiff():
    q, k, v = make_qkv(1, 64, 64, 2, 2, 64, seed=3)
    do = cotangent(q)
    _, dq, dk, dv = grads(q, k, v, do, implementation="xla")
    opts = sage_mod.resolve_options(q, k, v, causal=False, scale=None, smooth_k=True, smooth_q=False,
                                    qk_granularity="per_block", implementation="xla", interpret=False, config=SMALL)
    o, lse, ops = sage_mod._forward(q, k, v, opts=opts, transposed=False)
    ref = sage_backward_reference(ops, None, o, lse, do, sq_len=64, sk_len=64, causal=False, per_block=True,
                                  scale=opts.scale, config=opts.config)
    for ours, theirs in zip((dq, dk, dv), ref):
        np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))


def test_int8_backward_vs_16bit_ablation():
    q, k, v = make_qkv(1, 128, 128, 2, 2, 64, seed=4)
    do = cotangent(q)
    g_e = exact_grads(q, k, v, do, False)
    g8 = grads(q, k, v, do, implementation="xla")
    g16 = grads(q, k, v, do, implementation="xla", backward="bf16")
    np.testing.assert_array_equal(np.asarray(g8[0], np.float32), np.asarray(g16[0], np.float32))  # same forward
    for i in (1, 2, 3):
        _, rel8 = metrics(g8[i], g_e[i])
        _, rel16 = metrics(g16[i], g_e[i])
        assert rel16 < rel8, (i, rel16, rel8)  # INT8 dS/P/dO cost accuracy; the 16-bit path is the bound


def test_fully_masked_rows_have_finite_zero_gradients():
    q, k, v = make_qkv(1, 80, 30, 2, 2, 64, seed=5)
    do = cotangent(q)
    for impl in ("xla", "pallas"):
        o, dq, dk, dv = grads(q, k, v, do, causal=True, implementation=impl, interpret=INTERPRET)
        for g in (o, dq, dk, dv):
            assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))
        np.testing.assert_array_equal(np.asarray(dq[:, :50], np.float32), 0.0)  # rows 0..49 see no key


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_grad_under_jit_and_vmap(impl):
    q, k, v = make_qkv(1, 48, 40, 2, 1, 64, seed=6)
    f = functools.partial(lb.sage_attention, causal=True, implementation=impl, interpret=INTERPRET, config=SMALL)
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
    eager = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    stacked = [jnp.stack([x, x * 0.5]) for x in (q, k, v)]
    batched = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(*stacked)
    for e, j, bt in zip(eager, jitted, batched):
        np.testing.assert_allclose(np.asarray(j, np.float32), np.asarray(e, np.float32), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(bt[0], np.float32), np.asarray(e, np.float32), rtol=1e-5, atol=1e-5)
        assert float(jnp.max(jnp.abs(bt[1].astype(jnp.float32)))) > 0


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_grad_inside_shard_map_matches_single_device(impl):
    q, k, v = make_qkv(4, 40, 40, 2, 2, 64, seed=7)
    f = functools.partial(lb.sage_attention, causal=True, implementation=impl, interpret=INTERPRET, config=SMALL)
    out, ref = shard_map_grads(f, q, k, v)
    for a, r in zip(out, ref):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(r, np.float32), rtol=1e-5, atol=1e-5)


def test_error_report_table():
    q, k, v = make_qkv(1, 96, 96, 2, 1, 64, seed=8)
    do = cotangent(q)
    rep = lb.diagnostics.attention_error_report(q, k, v, do, causal=True, print_table=False, config=SMALL)
    assert list(rep) == ["O", "D", "P", "dP", "dS", "dQ", "dK", "dV"]
    for name, m in rep.items():
        assert 0.99 <= m["cos_sim"] <= 1.0 + 1e-6, name
        assert 0.0 < m["rel_l2"] < 0.1, name  # quantized: never exactly zero error
    rep_noisy = lb.diagnostics.attention_error_report(q, k, v, do, causal=True, print_table=False, config=SMALL,
                                                      backward="bf16")
    assert rep_noisy["dQ"]["rel_l2"] < rep["dQ"]["rel_l2"]


@pytest.mark.parametrize(
    "do, err, match",
    [
        (jnp.zeros((1, 32, 2, 64), jnp.bfloat16), ValueError, "do must have q's shape"),
        (jnp.zeros((1, 16, 2, 64), jnp.float32), TypeError, "do must have q's dtype"),
        ([[0.0]], TypeError, "do must be a jax or numpy array"),
    ],
)
def test_error_report_rejects_bad_do(do, err, match):
    q, k, v = make_qkv(1, 16, 16, 2, 2, 64)
    with pytest.raises(err, match=match):
        lb.diagnostics.attention_error_report(q, k, v, do, print_table=False)


def test_bad_backward_option():
    q, k, v = make_qkv(1, 16, 16, 2, 2, 64)
    with pytest.raises(ValueError, match="backward must be one of"):
        lb.sage_attention(q, k, v, backward="fp8")
    with pytest.raises(ValueError, match="method must be one of"):
        lb.diagnostics.attention_error_report(q, k, v, q, method="thrift")


# ----------------------------------------------------------------------------- Mosaic GPU backend

MOSAIC = lb.SageFwdConfig(block_q=64, block_k=128, dkdv_backend="mosaic", dq_backend="mosaic",
                          fwd_backend="mosaic")
MOSAIC_CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, causal, dtype, granularity): the forward and both backward kernels on Mosaic
    # (interpret on CPU), against the xla reference
    (1, 128, 256, 4, 2, 64, False, jnp.bfloat16, "per_block"),  # GQA
    (1, 256, 128, 2, 2, 128, False, jnp.float16, "per_token"),
    # Sq = 192 is not a multiple of a 128-query CTA: the forward and dQ fall back to Triton
    (2, 192, 128, 2, 1, 64, False, jnp.bfloat16, "per_block"),
    # causal: skipped and masked tiles; Sq < Sk (bottom-right aligned), ragged Sq, GQA
    (1, 256, 256, 2, 2, 128, True, jnp.bfloat16, "per_token"),
    (1, 200, 256, 4, 2, 64, True, jnp.bfloat16, "per_block"),
]


@pytest.mark.parametrize("case, pv_format", [(c, "int8") for c in MOSAIC_CASES]
                         + [(MOSAIC_CASES[0], "e4m3"), (MOSAIC_CASES[3], "e4m3")])
def test_mosaic_kernel_gradients_match_xla_backward(case, pv_format):
    """``pv_format="e4m3"``: the forward's FP8 P·V, and the backward's Ṽ from e4m3 codes (the fused dQ's pair-ordered
    Ṽ from the Triton pass, D64; the XLA-dequantized one, D128 per token)."""
    b, sq, sk, hq, hkv, d, causal, dtype, gran = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=dtype, seed=sq + 3 * sk, k_outlier=3.0)
    do = cotangent(q)
    kw = dict(qk_granularity=gran, config=dataclasses.replace(MOSAIC, pv_format=pv_format), causal=causal)
    g_m = grads(q, k, v, do, implementation="pallas", interpret=INTERPRET, **kw)
    g_x = grads(q, k, v, do, implementation="xla", **kw)  # the Triton kernels are held to it by the base tests
    for name, m, x in zip(("o", "dq", "dk", "dv"), g_m, g_x):
        assert m.dtype == dtype and m.shape == x.shape
        cos, rel = metrics(m, x)  # same quantization: accumulation order (and rare rounding ties) only
        assert rel <= 1e-3 and cos >= 0.99999, (name, cos, rel)


@pytest.mark.parametrize("dq_kernel, fwd_backend, d", [("fused", "triton", 64), ("separate", "triton", 64),
                                                        ("fused", "mosaic", 64), ("fused", "triton", 128)])
def test_mosaic_per_block_scales_differ_between_warpgroups(dq_kernel, fwd_backend, d):
    """Blocks of 64 keys and 64 queries: the two compute warpgroups of a dK/dV CTA (128 keys) hold K tiles with
    different per-block scales, and each takes its own scalar (``_mosaic.scalar``) for S and the fused dQ; in the
    Mosaic forward each warpgroup's 64 queries and each 64-key step take one scalar product of their scales. At
    head dim 128 the fused dQ is split by columns (``sage_bwd_mosaic._split_dq``): each warpgroup's half sums both
    warpgroups' dŜ tiles, the other's with the scale rebuilt from its tile-maximum words (swapped or shared
    scales would miss the reference by the 4× between the K blocks)."""
    q, k, v = make_qkv(1, 128, 256, 4, 2, d, dtype=jnp.bfloat16, seed=11, k_outlier=3.0)
    k = k * jnp.where(jnp.arange(256) % 128 < 64, 1.0, 4.0)[None, :, None, None].astype(k.dtype)
    q = q * jnp.where(jnp.arange(128) < 64, 1.0, 3.0)[None, :, None, None].astype(q.dtype)
    do = cotangent(q)
    cfg = dataclasses.replace(MOSAIC, block_k=64, fwd_backend=fwd_backend, dq_kernel=dq_kernel)
    kw = dict(qk_granularity="per_block", config=cfg, causal=True)
    got = grads(q, k, v, do, implementation="pallas", interpret=INTERPRET, **kw)
    want = grads(q, k, v, do, implementation="xla", **kw)
    for name, m, x in zip(("o", "dq", "dk", "dv"), got, want):
        cos, rel = metrics(m, x)
        assert rel <= 1e-3 and cos >= 0.99999, (name, cos, rel)


@pytest.mark.parametrize("case, schedule", [((1, 200, 256, 4, 2, 64, True), "after_dk"),
                                            ((1, 128, 256, 4, 2, 128, False), "after_dk"),
                                            ((1, 200, 256, 2, 1, 128, True), "after_dk"),
                                            ((1, 128, 256, 4, 2, 128, False), "under_dk"),
                                            ((1, 200, 256, 2, 1, 128, True), "under_dk")])
def test_mosaic_fused_dq_matches_separate(case, schedule, monkeypatch):
    """SageFwdConfig.dq_kernel: with per-block Q/K scales and per-tile dS, "fused" (and "auto") computes
    dQ in the Mosaic dK/dV kernel (the dQ kernel is not called; in the interpreter the per-block partial
    sums go to a workspace) and gives the separate dQ kernel's gradients (the same dŜ codes, other order).
    Ragged causal D64 and D128, non-causal D128 here; at 128 × 256 D64 each of the two is held to the xla
    reference by MOSAIC_CASES[0] (fused, non-causal), test_mosaic_per_block_scales_differ_between_warpgroups
    (both, causal) and test_fused_dq_only_with_the_dk_tiles_ds_tiles (separate, non-causal). At D128 with either
    ``split_dq_schedule``."""
    from pallas_kernels import sage_bwd_mosaic

    calls = []
    real = sage_bwd_mosaic.sage_bwd_dq_mosaic
    monkeypatch.setattr(sage_bwd_mosaic, "sage_bwd_dq_mosaic", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    b, sq, sk, hq, hkv, d, causal = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=jnp.bfloat16, seed=sq + sk + d, k_outlier=3.0)
    do = cotangent(q)
    got, n_calls = {}, {}
    fused = "auto" if d == 64 else "fused"  # "auto" fuses everywhere (SageFwdConfig.fuses_dq); both named
    for mode in (fused, "separate"):
        got[mode] = grads(q, k, v, do, implementation="pallas", interpret=INTERPRET, causal=causal,
                          qk_granularity="per_block",
                          config=dataclasses.replace(MOSAIC, dq_kernel=mode, split_dq_schedule=schedule))
        n_calls[mode] = len(calls)
    assert n_calls == {fused: 0, "separate": 1}
    for name, a, r in zip(("o", "dq", "dk", "dv"), got[fused], got["separate"]):
        cos, rel = metrics(a, r)
        assert a.dtype == r.dtype and rel <= 1e-3 and cos >= 0.99999, (name, cos, rel)
    assert sage_bwd_mosaic.supports_fused_dq(head_dim=64, per_block=True, ds_per_row=False)
    cfg = lb.SageFwdConfig()
    assert all(cfg.fuses_dq(d, causal) for d in (64, 128) for causal in (False, True))
    assert lb.SageFwdConfig(dq_kernel="fused").fuses_dq(128, True)
    assert not lb.SageFwdConfig(dq_kernel="separate").fuses_dq(64, False)
    assert not lb.SageFwdConfig(dq_kernel="fused", dq_block_k=32).fuses_dq(64, False)  # dQ's dS tiles differ
    for change in (dict(head_dim=32), dict(per_block=False), dict(ds_per_row=True)):
        assert not sage_bwd_mosaic.supports_fused_dq(**{**dict(head_dim=64, per_block=True, ds_per_row=False),
                                                        **change}), change
    with pytest.raises(ValueError, match="dq_kernel"):
        lb.SageFwdConfig(dq_kernel="atomic")


@pytest.mark.parametrize("d, causal, schedule", [(128, False, "after_dk"), (128, True, "after_dk"),
                                                 (128, True, "under_dk"), (64, True, "after_dk"),
                                                 (64, False, "after_dk")])
def test_mosaic_fused_dq_stage_protocol(monkeypatch, d, causal, schedule):
    """The fused dQ's TMA reduce-adds go through float32 SMEM stages, which each reduce-add may rewrite only after
    ``reduce_add.stage_free`` (wait for earlier copies to have read them). Each warpgroup makes one reduce-add a
    step from its one stage (at D128 its 64-column half of dQ, ``sage_bwd_mosaic._split_dq``), so the wait leaves
    no copy in flight, ``pending=0``. Where the stage is freed early the wait runs as the product's ``issued`` hook
    (while it is on the tensor cores), else inside ``reduce_add_out``; either way exactly one wait precedes each
    reduce-add. The interpreter's copies are
    synchronous, so a missing or too-loose wait would not change its values: the protocol is checked on the traced
    kernel (D64 causal: dQ's product joins dV's and dK's, freed early; D64 non-causal: after their wait, freed
    late; D128 "under_dk": freed while dQ's products run, added while dK's runs)."""
    from pallas_kernels import reduce_add

    q, k, v = make_qkv(1, 128, 128, 2, 1, d, dtype=jnp.bfloat16, seed=d)
    fn = functools.partial(lb.sage_attention, causal=causal, qk_granularity="per_block", implementation="pallas",
                           config=dataclasses.replace(MOSAIC, dq_kernel="fused", split_dq_schedule=schedule),
                           interpret=True)
    events = trace_stage_waits(monkeypatch, reduce_add, fn, q, k, v)
    assert [e[0] for e in events] == ["free", "out"], events  # one kernel trace: a wait before the add
    assert {e[1] for e in events if e[0] == "free"} == {0}
    assert {e[1] for e in events if e[0] == "out"} == {d > 64 or causal}


def test_fused_dq_only_with_the_dk_tiles_ds_tiles():
    """The fused dQ uses dK's dŜ (per bwd_block_q × bwd_block_k tile) for dQ too, which is SageBwd's dQ only when
    dq_block_k = bwd_block_k; with narrower dQ tiles (dS quantized per (64 × 32) for dQ) the separate dQ kernel
    runs even with dq_kernel="fused", and the gradients are the reference's."""
    q, k, v = make_qkv(1, 128, 256, 4, 2, 64, dtype=jnp.bfloat16, seed=5, k_outlier=3.0)
    do = cotangent(q)
    cfg = dataclasses.replace(MOSAIC, dq_block_k=32, dq_kernel="fused")
    kw = dict(qk_granularity="per_block", config=cfg)
    got = grads(q, k, v, do, implementation="pallas", interpret=INTERPRET, **kw)
    want = grads(q, k, v, do, implementation="xla", **kw)
    for name, m, x in zip(("o", "dq", "dk", "dv"), got, want):
        cos, rel = metrics(m, x)
        assert rel <= 1e-3 and cos >= 0.99999, (name, cos, rel)


def test_mosaic_int8_operand_tiles_only_where_used():
    """Compiled, at head dims 64 and 128, P̂ᵀ and dŜ are ``wgmma`` operands from registers, so the SageBwd
    kernels allocate no SMEM tiles for them (lowered in tests/test_lowering.py); interpreted they go through
    SMEM (the interpreter tests above run that path)."""
    from pallas_kernels import register_operands, sage_bwd_mosaic

    assert sage_bwd_mosaic._smem_operands(True)
    assert sage_bwd_mosaic._smem_operands(False) == (not register_operands.relayout_8bit())


def test_mosaic_backend_selection():
    """Which kernels Mosaic covers; 'auto' keeps Triton in interpret mode and off Hopper."""
    from pallas_kernels import sage_bwd_mosaic

    ok = dict(sq_len=256, sk_len=256, sq_pad=256, sk_pad=256, head_dim=128, causal=False, has_bias=False,
              config=MOSAIC)
    assert sage_bwd_mosaic.supports("dkdv", **ok) and sage_bwd_mosaic.supports("dq", **ok)
    assert sage_bwd_mosaic.supports("dq", **{**ok, "causal": True})
    for change in (dict(has_bias=True), dict(head_dim=32), dict(sk_len=250), dict(causal=True, sq_len=300, sq_pad=320),
                   dict(config=lb.SageFwdConfig(block_q=32, block_k=64))):
        assert not sage_bwd_mosaic.supports("dkdv", **{**ok, **change}), change
        assert not sage_bwd_mosaic.supports("dq", **{**ok, **change}), change
    assert not sage_bwd_mosaic.supports("dq", **{**ok, "sq_pad": 192})
    assert sage_bwd_mosaic.supports("dkdv", **{**ok, "sq_pad": 192})
    with pytest.raises(ValueError, match="kernel must be"):
        sage_bwd_mosaic.supports("dp", **ok)
    from lowbit_jax import sage_backends as backends

    q, k, v = make_qkv(1, 128, 128, 2, 2, 64)
    opts = sage_mod.resolve_options(q, k, v, implementation="pallas", interpret=True, config=lb.SageFwdConfig())
    call = backends.SageCall.of_operands(sage_mod._forward(q, k, v, opts=opts, transposed=True)[2], opts)
    assert call == backends.SageCall.of_inputs(q, k, opts)  # the padding the quantize kernels give
    assert not backends._mosaic_kernel("dq", call)  # auto + interpret → Triton
    mosaic = call._replace(opts=dataclasses.replace(opts, config=MOSAIC))
    assert backends._mosaic_kernel("dq", mosaic)
    q_smoothed = mosaic._replace(opts=dataclasses.replace(mosaic.opts, smooth_q=True))
    assert not backends._mosaic_kernel("dq", q_smoothed)  # Q-smoothing bias → Triton
    assert backends._mosaic_kernel("dq", mosaic._replace(opts=dataclasses.replace(mosaic.opts, causal=True)))
    with pytest.raises(ValueError, match="dq_backend must be one of"):
        lb.SageFwdConfig(dq_backend="cuda")


@pytest.mark.parametrize("d, seq, causal, want", [
    # all Mosaic at D128 and D64, causal or not (the forward at D64 since 2026-12-01)
    (128, 256, False, dict(fwd=True, dkdv=True, dq=True)),
    (128, 256, True, dict(fwd=True, dkdv=True, dq=True)),
    (64, 256, False, dict(fwd=True, dkdv=True, dq=True)),
    (64, 256, True, dict(fwd=True, dkdv=True, dq=True)),
    (128, 192, False, dict(fwd=False, dkdv=False, dq=False)),  # Sq_pad not a multiple of two warpgroups' rows
])
def test_auto_backend_on_hopper(monkeypatch, d, seq, causal, want):
    """'auto' on Hopper picks the Mosaic forward, dK/dV and dQ kernels wherever they cover the call; interpreted,
    or off Hopper, Triton."""
    from lowbit_jax import sage_backends as backends

    q, k, v = make_qkv(1, seq, seq, 2, 2, d)
    opts = sage_mod.resolve_options(q, k, v, causal=causal, implementation="pallas", interpret=True,
                                    config=lb.SageFwdConfig())
    call = backends.SageCall.of_operands(sage_mod._forward(q, k, v, opts=opts, transposed=True)[2], opts)

    def picks(opts):
        c = call._replace(opts=opts)
        return dict(fwd=backends.forward_for(c).name == "mosaic", dkdv=backends.backward_for(c).name == "mosaic",
                    dq=backends._mosaic_kernel("dq", c))

    assert not any(picks(opts).values())  # interpreted
    compiled = dataclasses.replace(opts, interpret=False)
    assert not any(picks(compiled).values())  # not on Hopper (this test runs off the GPU)
    monkeypatch.setattr(backends, "on_hopper", lambda: True)
    assert picks(compiled) == want
    assert not picks(dataclasses.replace(compiled, smooth_q=True))["fwd"]  # Q-smoothing bias → Triton


# ----------------------------------------------------------------------------- dS scale granularity

ROW = dict(ds_scale="row")
DS_ROW_CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, causal, dtype, granularity, smooth_q, config): Triton, then Mosaic kernels
    (1, 100, 77, 4, 2, 64, True, jnp.bfloat16, "per_block", False, dataclasses.replace(SMALL, **ROW)),
    (1, 70, 130, 2, 1, 128, False, jnp.float32, "per_token", True,
     lb.SageFwdConfig(32, 64, bwd_block_q=32, bwd_block_k=32, dq_block_k=64, **ROW)),
    (1, 128, 256, 4, 2, 64, False, jnp.bfloat16, "per_block", False, dataclasses.replace(MOSAIC, **ROW)),
    (1, 200, 256, 4, 2, 128, True, jnp.float16, "per_token", False, dataclasses.replace(MOSAIC, **ROW)),
]


@pytest.mark.parametrize("case", DS_ROW_CASES)
def test_ds_row_scales_kernels_match_xla(case):
    """ds_scale="row" (one dS scale per key for dK, per query row for dQ): kernels ↔ xla reference."""
    b, sq, sk, hq, hkv, d, causal, dtype, gran, smooth_q, cfg = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=dtype, seed=sq + sk + 1, k_outlier=3.0)
    do = cotangent(q)
    kw = dict(causal=causal, qk_granularity=gran, smooth_q=smooth_q, config=cfg)
    g_p = grads(q, k, v, do, implementation="pallas", interpret=INTERPRET, **kw)
    g_x = grads(q, k, v, do, implementation="xla", **kw)
    g_tile = grads(q, k, v, do, implementation="xla", **dict(kw, config=dataclasses.replace(cfg, ds_scale="tile")))
    for name, a, x, t in zip(("o", "dq", "dk", "dv"), g_p, g_x, g_tile):
        cos, rel = metrics(a, x)
        assert rel <= 1e-3 and cos >= 0.99999, (name, cos, rel)
        if name in ("o", "dv"):  # dS feeds only dQ and dK
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(t, np.float32))
        else:
            assert metrics(x, t)[1] > 1e-4, name  # a different quantization, not the tile one again


def test_ds_row_scales_are_more_accurate():
    """Finer dS scales: dQ and dK closer to exact autodiff than one scale per tile (N(0,1), K outliers)."""
    q, k, v = make_qkv(2, 256, 256, 4, 2, 64, seed=11, k_outlier=3.0)
    do = cotangent(q)
    exact = exact_grads(q, k, v, do, causal=True)
    errs = {}
    for ds_scale in ("tile", "row"):
        cfg = lb.SageFwdConfig(64, 64, ds_scale=ds_scale)
        g = grads(q, k, v, do, causal=True, implementation="xla", config=cfg)
        errs[ds_scale] = [metrics(g[i], exact[i])[1] for i in (1, 2)]
    for tile, row in zip(errs["tile"], errs["row"]):
        assert row < 0.9 * tile, errs


def test_bad_ds_scale():
    with pytest.raises(ValueError, match="ds_scale must be one of"):
        lb.SageFwdConfig(ds_scale="block")


#: causal backward cases (B, Sq, Sk, Hq, Hkv, D, granularity): the fused dK/dV/dQ kernel at D64 ragged GQA and at
#: D128, and per-token scales (the dK/dV and dQ kernels) at ragged MQA
CAUSAL_CASES = [(1, 200, 256, 4, 2, 64, "per_block"), (1, 256, 256, 2, 2, 128, "per_block"),
                (1, 256, 384, 2, 1, 128, "per_token")]


def _causal_inputs(case: tuple, seed: int) -> tuple:
    """q, k, v (K with channel outliers), dO and the causal Mosaic options of a :data:`CAUSAL_CASES` entry."""
    b, sq, sk, hq, hkv, d, gran = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=jnp.bfloat16, seed=sq + sk + d + seed, k_outlier=3.0)
    return q, k, v, cotangent(q), dict(causal=True, qk_granularity=gran, config=MOSAIC)


@pytest.mark.parametrize("sk_pad, v_operand_order, dtype", [(128, True, jnp.bfloat16), (192, False, jnp.float16),
                                                             (64, True, jnp.float16)])
def test_kv_operands_kernel_matches_xla_transposes(sk_pad, v_operand_order, dtype):
    """``sage_bwd_kv_operands`` (one Triton pass): K̂ and Ṽ in pair order, exactly what the XLA route gives
    (``key_pairs.to_pair_order`` of K̂ and of ``sage_bwd_mosaic.dequantized_v``), with V̂ᵀ's keys in operand
    order or not; Sk_pad 192 is not a multiple of the 128-key program (64-key programs then)."""
    from pallas_kernels import key_pairs, sage_bwd, sage_bwd_mosaic

    rng = np.random.default_rng(sk_pad)
    k8 = jnp.asarray(rng.integers(-127, 128, (2, 3, sk_pad, 64)), jnp.int8)
    vt8 = jnp.asarray(rng.integers(-127, 128, (2, 3, 64, sk_pad)), jnp.int8)
    v_scale = jnp.asarray(rng.uniform(0.001, 0.1, (2, 3, 64)), jnp.float32)
    kp, vd = sage_bwd.sage_bwd_kv_operands(k8, vt8, v_scale, dtype=dtype, v_operand_order=v_operand_order,
                                           interpret=INTERPRET)
    ref_v = sage_bwd_mosaic.dequantized_v(vt8, v_scale, dtype, keys_in_operand_order=v_operand_order)
    assert vd.dtype == dtype and kp.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(kp), np.asarray(key_pairs.to_pair_order(k8, 2)))
    np.testing.assert_array_equal(np.asarray(vd, np.float32), np.asarray(key_pairs.to_pair_order(ref_v, 2), np.float32))
    with pytest.raises(ValueError, match="multiple of 16"):
        sage_bwd.sage_bwd_kv_operands(k8[:, :, :8], vt8[..., :8], v_scale, dtype=dtype, interpret=INTERPRET)


def test_preprocess_zeroes_the_dq_accumulator():
    """``sage_bwd_preprocess(zero_dq=True)`` also returns the fused backward's float32 dQ accumulator (B, Sq_pad, Hq,
    D), every element zero (the interpreter starts outputs as NaN, so an unwritten block shows), and its other
    outputs are the ones without it; ragged Sq (pad rows zeroed too)."""
    from pallas_kernels import sage_bwd

    o, do, _ = make_qkv(2, 100, 100, 3, 3, 64, dtype=jnp.bfloat16, seed=41)
    cfg = lb.SageFwdConfig(64, 64, bwd_block_q=32)
    *plain, = sage_bwd.sage_bwd_preprocess(o, do, config=cfg, interpret=INTERPRET)
    *with_zeros, zeros = sage_bwd.sage_bwd_preprocess(o, do, config=cfg, zero_dq=True, interpret=INTERPRET)
    assert zeros.shape == (2, 128, 3, 64) and zeros.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(zeros), 0.0)
    for a, r in zip(with_zeros, plain, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
