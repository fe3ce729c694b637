"""sage_attention forward: Pallas kernels (interpret on CPU) ↔ xla reference ↔ exact float64."""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit_jax as lb
from attention_base import INTERPRET, AttentionTestBase, exact_attention_f64, make_qkv, metrics
from lowbit_jax import sage as sage_mod

SMALL = lb.SageFwdConfig(block_q=32, block_k=32)  # several tiles even on short test sequences


class SageXla(AttentionTestBase):
    implementation = "xla"

    def run(self, q, k, v, **options):
        options.setdefault("config", SMALL)
        return lb.sage_attention(q, k, v, implementation=self.implementation, interpret=self.interpret, **options)


class TestSageXla(SageXla):
    @pytest.mark.parametrize("case", AttentionTestBase.AWKWARD_CASES)
    def test_close_to_exact(self, case):
        self.check_awkward_case(case)

    @pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
    def test_dtypes(self, dtype):
        self.check_awkward_case((1, 64, 96, 2, 2, 64, False), dtype=dtype)

    def test_k_outliers_need_smoothing(self):
        q, k, v = make_qkv(1, 128, 128, 2, 2, 64, k_outlier=10.0, seed=5)
        ref = exact_attention_f64(q, k, v)
        _, rel_on = metrics(self.run(q, k, v, smooth_k=True), ref)
        _, rel_off = metrics(self.run(q, k, v, smooth_k=False), ref)
        assert rel_on <= 0.03
        assert rel_off > 2.0 * rel_on, (rel_on, rel_off)

    def test_per_token_and_q_smoothing(self):
        q, k, v = make_qkv(1, 96, 96, 2, 1, 64, seed=6, q_heavy_tail=True)
        ref = exact_attention_f64(q, k, v, causal=True)
        rels = {}
        for gran in ("per_block", "per_token"):
            for sq in (False, True):
                out = self.run(q, k, v, causal=True, qk_granularity=gran, smooth_q=sq)
                cos, rels[gran, sq] = metrics(out, ref)
                assert cos >= 0.999
        assert rels["per_token", False] < rels["per_block", False]  # heavy-tailed Q: per-token is finer

    def test_empty_rows_are_zero(self):
        q, k, v = make_qkv(1, 80, 30, 2, 2, 64, seed=7)
        out = self.run(q, k, v, causal=True)
        np.testing.assert_array_equal(np.asarray(out[:, :50], np.float32), 0.0)  # rows 0..49 see no key
        assert np.all(np.abs(np.asarray(out[:, 50:], np.float32)).sum(-1) > 0)

    def test_matches_jax_causal_for_equal_lengths(self):
        q, k, v = make_qkv(1, 64, 64, 2, 2, 64, seed=8)
        ours = self.run(q, k, v, causal=True)
        theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        cos, rel = metrics(ours, theirs)
        assert cos >= 0.999 and rel <= 0.03

    def test_under_jit_and_vmap(self):
        q, k, v = make_qkv(1, 48, 48, 2, 2, 64, seed=9)
        f = functools.partial(self.run, causal=True)
        eager = f(q, k, v)
        jitted = jax.jit(f)(q, k, v)
        np.testing.assert_allclose(np.asarray(jitted, np.float32), np.asarray(eager, np.float32), atol=1e-6)
        batched = jax.vmap(f)(q[None], k[None], v[None])[0]
        np.testing.assert_allclose(np.asarray(batched, np.float32), np.asarray(eager, np.float32), atol=1e-6)

    def test_scale_argument(self):
        q, k, v = make_qkv(1, 64, 64, 2, 2, 64, seed=10)
        out = self.run(q, k, v, scale=0.3)
        cos, rel = metrics(out, exact_attention_f64(q, k, v, scale=0.3))
        assert cos >= 0.999 and rel <= 0.03


class TestSagePallas(SageXla):
    """The kernels (interpret mode on CPU) must match the reference with the same quantization."""

    implementation = "pallas"

    KERNEL_CASES = [
        # (B, Sq, Sk, Hq, Hkv, D, causal, dtype, granularity, smooth_q)
        (1, 100, 77, 4, 2, 64, True, jnp.bfloat16, "per_block", False),
        (2, 64, 64, 2, 2, 128, False, jnp.bfloat16, "per_block", False),
        (1, 70, 130, 2, 1, 64, False, jnp.float16, "per_token", True),
        (1, 130, 60, 2, 1, 128, True, jnp.bfloat16, "per_token", False),
        (1, 33, 100, 4, 2, 64, True, jnp.float32, "per_block", True),
    ]

    @pytest.mark.parametrize("case", KERNEL_CASES)
    def test_kernel_matches_reference(self, case):
        b, sq, sk, hq, hkv, d, causal, dtype, gran, smooth_q = case
        q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=dtype, seed=sq + sk, k_outlier=3.0)
        kw = dict(causal=causal, qk_granularity=gran, smooth_q=smooth_q, config=SMALL)
        o_p, l_p, ops_p = lb.sage_forward(q, k, v, implementation="pallas", interpret=self.interpret, **kw)
        o_x, l_x, ops_x = lb.sage_forward(q, k, v, implementation="xla", **kw)
        # The fused quantize kernel produces exactly the reference's codes and scales.
        for name in ops_x._fields:
            a, c = getattr(ops_p, name), getattr(ops_x, name)
            assert (a is None) == (c is None), name
            if a is not None:
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32), rtol=1e-6, atol=1e-6,
                                           err_msg=name)
        # Attention: same quantization, so agreement to accumulation order.
        cos, rel = metrics(o_p, o_x)
        assert rel <= 2e-3 and cos >= 0.99999, (cos, rel)
        np.testing.assert_array_equal(np.isinf(np.asarray(l_p)), np.isinf(np.asarray(l_x)))
        fin = np.isfinite(np.asarray(l_x))
        np.testing.assert_allclose(np.asarray(l_p)[fin], np.asarray(l_x)[fin], atol=1e-4)
        self.assert_close_to_exact(o_p, q, k, v, causal=causal)

    def test_lse_is_base2_of_smoothed_scaled_scores(self):
        q, k, v = make_qkv(1, 40, 50, 2, 2, 64, seed=11, dtype=jnp.float32)
        _, lse, _ = lb.sage_forward(q, k, v, implementation=self.implementation, interpret=self.interpret,
                                    config=SMALL)
        scale = 64**-0.5
        ks = np.asarray(k, np.float64) - np.asarray(k, np.float64).mean(1, keepdims=True)
        s = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), ks) * scale * np.log2(np.e)
        m = s.max(-1)
        ref = m + np.log2(np.exp2(s - m[..., None]).sum(-1))
        np.testing.assert_allclose(np.asarray(lse), ref, atol=0.05)


def test_default_implementation_on_cpu_is_xla():
    q, k, v = make_qkv(1, 32, 32, 2, 2, 64)
    if jax.default_backend() == "cpu":
        opts = sage_mod.resolve_options(q, k, v, causal=False, scale=None, smooth_k=True, smooth_q=False,
                                        qk_granularity="per_block", implementation=None, interpret=False,
                                        config=None)
        assert opts.implementation == "xla"
    out = lb.sage_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype


def test_config_fitted_to_short_sequences():
    cfg = lb.SageFwdConfig(block_q=128, block_k=128).fitted(20, 5)
    assert (cfg.block_q, cfg.block_k) == (32, 32)
    with pytest.raises(ValueError, match="block_k"):
        lb.SageFwdConfig(block_k=48)


def test_kv_quantize_kernel_takes_its_own_warps(monkeypatch):
    """``kv_quant_warps`` launches the K/V quantize kernel (None: ``quant_warps``), ``quant_warps`` Q's; on the H200
    and the H100 (the default of every device) K/V takes 8 at head dim 128 only; not a power of two is rejected."""
    from pallas_kernels import quantize as quantize_kernels

    assert lb.SageFwdConfig(quant_warps=2).kv_quant_warps == 2
    with pytest.raises(ValueError, match="kv_quant_warps"):
        lb.SageFwdConfig(kv_quant_warps=6)
    for kind in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "another GPU"):
        assert [lb.sage_fwd_config(d, c, kind).kv_quant_warps for d in (64, 128) for c in (False, True)] == [
            4, 4, 8, 8], kind
    seen = {}
    for name in ("sage_quantize_q", "sage_quantize_kv"):
        real = getattr(quantize_kernels, name)

        def spy(*args, _real=real, _name=name, **kw):
            seen[_name] = kw["num_warps"]
            return _real(*args, **kw)

        monkeypatch.setattr(quantize_kernels, name, spy)
    q, k, v = make_qkv(1, 40, 50, 2, 1, 64, seed=13)
    config = dataclasses.replace(SMALL, quant_warps=2, kv_quant_warps=8)
    o = lb.sage_attention(q, k, v, config=config, implementation="pallas", interpret=INTERPRET)
    assert seen == {"sage_quantize_q": 2, "sage_quantize_kv": 8}
    ref = lb.sage_attention(q, k, v, config=SMALL, implementation="pallas", interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(ref, np.float32))


def _forward_per_switch(monkeypatch, module, switch: str, q, k, v, causal: bool, config) -> dict:
    """``{on: (o, lse)}`` of the Pallas ``sage_forward`` with ``module.switch`` on (first), then off; caches cleared
    before each, so each traces anew."""
    got = {}
    for on in (True, False):
        monkeypatch.setattr(module, switch, on)
        jax.clear_caches()
        o, lse, _ = lb.sage_forward(q, k, v, causal=causal, config=config, implementation="pallas",
                                    interpret=INTERPRET)
        got[on] = np.asarray(o, np.float32), np.asarray(lse, np.float32)
    return got


def _assert_same_forward(got: dict, q, k, v, causal: bool, config) -> None:
    """``got`` from :func:`_forward_per_switch` of a switch that orders execution or splits work only: o and the
    log-sum-exp equal exactly with it on and off; o finite, of q's shape, and near the xla path's."""
    (o_on, lse_on), (o_off, lse_off) = got[True], got[False]
    assert np.isfinite(o_on).all() and o_on.shape == q.shape
    np.testing.assert_array_equal(lse_on, lse_off)
    np.testing.assert_array_equal(o_on, o_off)
    x = lb.sage_attention(q, k, v, causal=causal, config=config, implementation="xla")
    assert metrics(o_on, x)[1] < 2e-3


def test_interpreter_pool_fits_four_warpgroups():
    """The D64 Mosaic forward runs four warpgroups per CTA (three compute, one memory); interpreted, each is a thread
    whose barrier waits hold a thread of XLA's CPU intra-op pool ("tf_XLAEigen", max(cores, host devices) threads),
    and the pallas_call's own callback holds one more. Three waiting warpgroups, that callback and the warpgroup they
    wait for need five: with four (four host devices, 2 cores) the interpreter deadlocked. tests/conftest.py forces
    eight host devices; this fails if that is lost (instead of an intermittent hang). The pool is also the count
    ``_mosaic.interpreter_threads`` refuses a kernel by (``check_interpreter_threads``)."""
    from pallas_kernels import _mosaic

    tasks = Path("/proc/self/task")
    if jax.default_backend() != "cpu" or not tasks.exists():
        pytest.skip("counts XLA's CPU threads on Linux: only the CPU runs the interpreter")
    jax.jit(lambda x: x @ x)(jnp.ones((64, 64))).block_until_ready()
    names = [(t / "comm").read_text().strip() for t in tasks.iterdir() if (t / "comm").exists()]
    assert names.count("tf_XLAEigen") >= 5, (len(jax.devices()), sorted(set(names)))
    assert names.count("tf_XLAEigen") == _mosaic.interpreter_threads()


@pytest.mark.parametrize("s, chunk, smooth_k", [(300, 128, True), (256, 256, True), (77, 256, False)])
def test_channel_stats_kernel_matches_xla(s, chunk, smooth_k):
    """``sage_channel_stats`` (one pass over K and V, partials per chunk of tokens): V's scale equal to XLA's
    (``sage_reference.channel_stats``), K's mean to float32 rounding, ragged lengths (the last chunk's padding
    rows must not count), a K with a large channel offset, no K mean without smoothing."""
    from lowbit_jax.sage_reference import channel_stats
    from pallas_kernels import quantize as quantize_kernels

    _, k, v = make_qkv(2, 8, s, 3, 3, 64, seed=s + chunk, k_outlier=5.0)
    v = v.at[1, s - 1, 2, 7].set(-40.0)  # the maximum sits in the last, partial chunk
    k_mean, v_scale = quantize_kernels.sage_channel_stats(k, v, smooth_k=smooth_k, chunk=chunk, interpret=INTERPRET)
    ref_mean, ref_scale = channel_stats(k, v, smooth_k)
    np.testing.assert_array_equal(np.asarray(v_scale), np.asarray(ref_scale))
    assert float(v_scale[1, 2, 7]) == np.float32(40.0) / np.float32(127.0)
    if smooth_k:
        np.testing.assert_allclose(np.asarray(k_mean), np.asarray(ref_mean), rtol=2e-6, atol=1e-7)
    else:
        assert k_mean is None and ref_mean is None


@pytest.mark.parametrize("backend", ["library", "triton"])
def test_benchmark_parts_give_the_library_output(backend):
    """benchmarks/attention.py times the quantize pass and the attention kernel apart (``sage_parts``, with the
    backend the library picks or the Triton one its tile sweep tunes); run one after the other they give what
    ``sage_attention`` gives."""
    from benchmarks.attention import sage_parts

    q, k, v = make_qkv(1, 128, 128, 2, 2, 64, dtype=jnp.bfloat16, seed=3)
    cfg = dataclasses.replace(lb.SageFwdConfig(block_q=64, block_k=128), fwd_backend="mosaic")
    quant, kern, ops, name = sage_parts(q, k, v, False, cfg, interpret=INTERPRET, backend=backend)
    assert name == ("mosaic" if backend == "library" else "triton")
    want = lb.sage_attention(q, k, v, implementation="pallas", interpret=INTERPRET,
                             config=cfg if backend == "library" else dataclasses.replace(cfg, fwd_backend="triton"))
    np.testing.assert_array_equal(np.asarray(kern(quant(q, k, v)), np.float32), np.asarray(want, np.float32))


def test_pv_format_is_checked_and_hopper_takes_e4m3(monkeypatch):
    """``SageFwdConfig.pv_format``: one of "int8"/"e4m3"; sage_fwd_config picks e4m3 on Hopper (where the Mosaic
    forward measured faster with it), INT8 elsewhere; e4m3 on a GPU below sm_89 is refused before compiling (the
    Pallas kernels cannot convert to it there), not in the interpreter or the XLA reference."""
    import types

    from lowbit_jax import _checks

    with pytest.raises(ValueError, match="pv_format"):
        lb.SageFwdConfig(pv_format="fp8")
    for kind, fmt in (("NVIDIA H200", "e4m3"), ("NVIDIA H100 80GB HBM3", "e4m3"), ("NVIDIA GH200 480GB", "e4m3"),
                      ("NVIDIA A100-SXM4-80GB", "int8"), ("NVIDIA L40S", "int8"), ("cpu", "int8")):
        assert {lb.sage_fwd_config(d, c, kind).pv_format for d in (64, 128) for c in (False, True)} == {fmt}, kind
    for cc, refused in (("8.0", True), ("8.9", False), ("9.0", False)):
        monkeypatch.setattr(_checks.jax, "devices", lambda cc=cc: [types.SimpleNamespace(compute_capability=cc)])
        check = functools.partial(_checks.check_fp8_device, "config.pv_format")
        if refused:
            with pytest.raises(ValueError, match="config.pv_format='e4m3' needs an sm_89"):
                check("e4m3", "pallas", False)
        else:
            check("e4m3", "pallas", False)
        check("e4m3", "pallas", True)
        check("e4m3", "xla", False)
        check("int8", "pallas", False)
