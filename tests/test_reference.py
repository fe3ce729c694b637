"""Exact reference attention and metrics."""

import jax.numpy as jnp
import numpy as np
import pytest

import lowbit_jax as lb
from attention_base import exact_attention_f64, make_qkv


@pytest.mark.parametrize("case", [(1, 37, 53, 4, 2, 64, True), (2, 64, 64, 2, 1, 128, False), (1, 50, 20, 2, 2, 32, True)])
def test_reference_matches_float64(case):
    b, sq, sk, hq, hkv, d, causal = case
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=jnp.float32, seed=3)
    out = lb.reference_attention(q, k, v, causal=causal)
    np.testing.assert_allclose(np.asarray(out), exact_attention_f64(q, k, v, causal=causal), atol=2e-6, rtol=1e-5)


def test_metrics():
    x = jnp.array([1.0, -2.0, 3.0])
    assert float(lb.cos_sim(x, x)) == pytest.approx(1.0)
    assert float(lb.cos_sim(-x, x)) == pytest.approx(-1.0)
    y = x * 1.1
    assert float(lb.rel_l1(y, x)) == pytest.approx(0.1, rel=1e-5)
    assert float(lb.rel_l2(y, x)) == pytest.approx(0.1, rel=1e-5)
    assert float(lb.rmse(y, x)) == pytest.approx(float(jnp.sqrt(jnp.mean((0.1 * x) ** 2))), rel=1e-5)
    m = lb.error_metrics(y, x)
    assert set(m) == {"cos_sim", "rel_l1", "rel_l2", "rmse"}
