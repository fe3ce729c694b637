"""The public API under ``jax_enable_x64``: every function runs, forward and gradient, xla and Pallas, and gives
the values it gives with x64 off (its arithmetic is 32-bit by contract)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit_jax as lb
from attention_base import INTERPRET, make_qkv

METHODS = {"sage": lb.sage_attention, "qat": lb.qat_attention, "thrift": lb.thrift_attention}


def _fwd_bwd(method, impl, causal, q, k, v):
    kw = dict(causal=causal, implementation=impl, interpret=INTERPRET and impl == "pallas")
    o, vjp = jax.vjp(lambda q, k, v: METHODS[method](q, k, v, **kw), q, k, v)
    return [np.asarray(x) for x in (o, *vjp(jnp.ones_like(o)))]


@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
@pytest.mark.parametrize("method", list(METHODS))
def test_attention_under_x64_equals_x32(method, impl):
    q, k, v = make_qkv(1, 80, 80, 4, 2, 64, dtype=jnp.float32)  # ragged, GQA
    expected = _fwd_bwd(method, impl, True, q, k, v)
    with jax.enable_x64(True):
        got = _fwd_bwd(method, impl, True, q, k, v)
    for e, g in zip(expected, got):
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("impl, backend", [("xla", "auto"), pytest.param("pallas", "triton", marks=pytest.mark.slow),
                                           pytest.param("pallas", "mosaic", marks=pytest.mark.slow)])
def test_thrift_cache_and_decode_under_x64(impl, backend):
    q, k, v = make_qkv(1, 70, 70, 4, 2, 64)
    kw = dict(implementation=impl, interpret=INTERPRET and impl == "pallas",
              config=lb.ThriftConfig(decode_backend=backend))

    def run():
        cache = lb.ThriftKVCache.create(1, 128, 2, 64).append(k, v)
        return np.asarray(lb.thrift_decode(q[:, -2:], cache, budget=0.5, **kw), np.float32), int(cache.length)

    expected = run()
    with jax.enable_x64(True):
        got = run()
    np.testing.assert_array_equal(got[0], expected[0])
    assert got[1] == expected[1] == 70


def test_formats_selection_and_diagnostics_under_x64():
    q, k, v = make_qkv(1, 64, 64, 2, 2, 64, dtype=jnp.float32)

    def run():
        t = lb.nvfp4.quantize(q)
        codes, scale = lb.int8.quantize(q)
        cos, _ = lb.rope_tables(jnp.arange(8), 64)
        report = lb.diagnostics.attention_error_report(q, k, v, q, method="qat", print_table=False)
        return (np.asarray(lb.nvfp4.dequantize(t)), np.asarray(codes), np.asarray(scale), np.asarray(cos),
                np.asarray(jax.grad(lambda x: lb.nvfp4.fake_quant(x).sum())(q)),
                np.asarray(lb.thrift_select(q, k, budget=0.5)), report["dQ"]["cos_sim"])

    expected = run()
    with jax.enable_x64(True):
        got = run()
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(g, e)
