"""lowbit_jax.block_sparse_attention (the baseline ThriftAttention is measured against) vs a float64 oracle that
attends over the same selected block pairs; budget 1 is exact attention; the model's "sparse" method."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit_jax as lb
from oracle import exact


def _oracle(q, k, v, selected, block, causal):
    """float64 (B, Sq, Hq, D): softmax over the keys of selected blocks (and visible), per head; 0 for a row
    that keeps no key."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, group = k.shape[1], hq // k.shape[2]
    vis = exact.visible(sq, sk, causal)
    out = np.zeros_like(q)
    for bi in range(b):
        for h in range(hq):
            keep = np.repeat(np.repeat(np.asarray(selected[bi, h]), block, 0)[:sq], block, 1)[:, :sk] & vis
            s = np.where(keep, q[bi, :, h] @ k[bi, :, h // group].T / np.sqrt(d), -np.inf)
            rows = keep.any(-1)
            p = np.exp(s[rows] - s[rows].max(-1, keepdims=True))
            out[bi, rows, h] = (p / p.sum(-1, keepdims=True)) @ v[bi, :, h // group]
    return out


@pytest.mark.parametrize("sq, sk, hq, hkv, d, causal", [(300, 300, 4, 2, 64, True), (128, 384, 2, 1, 128, True),
                                                        (200, 456, 4, 4, 64, False)])
@pytest.mark.parametrize("budget", [0.0, 0.3, 1.0])
def test_matches_the_oracle_over_the_selected_blocks(sq, sk, hq, hkv, d, causal, budget):
    ks = jax.random.split(jax.random.PRNGKey(sq + sk), 3)
    q = jax.random.normal(ks[0], (2, sq, hq, d), jnp.float32)
    k = jax.random.normal(ks[1], (2, sk, hkv, d), jnp.float32)
    v = jax.random.normal(ks[2], (2, sk, hkv, d), jnp.float32)
    got = np.asarray(lb.block_sparse_attention(q, k, v, causal=causal, budget=budget))
    selected = lb.thrift_select(q, k, causal=causal, budget=budget, implementation="xla")
    want = _oracle(q, k, v, selected, lb.ThriftConfig().block, causal)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5)  # float32 vs float64; a wrong block mask differs by O(1)
    if budget == 1.0:
        np.testing.assert_allclose(got, exact.attention(q, k, v, causal=causal), atol=2e-5)
    else:  # dropping blocks changes the output
        assert np.abs(got - exact.attention(q, k, v, causal=causal)).max() > 1e-2


def test_bad_budget_is_refused_before_tracing():
    x = jnp.zeros((1, 128, 2, 64))
    with pytest.raises(ValueError, match="budget must be in"):
        lb.block_sparse_attention(x, x, x, budget=1.5)


def test_model_sparse_method_has_no_cache_path():
    from flax import nnx

    from models import TransformerLM, model_config

    model = TransformerLM(model_config("tiny", method="sparse", dtype="float32"), rngs=nnx.Rngs(0),
                          attention_options={"budget": 0.5})
    logits = model(jnp.zeros((1, 256), jnp.int32))
    assert np.isfinite(np.asarray(logits)).all()
    with pytest.raises(ValueError, match="no KV-cache path"):
        model.prefill(jnp.zeros((1, 8), jnp.int32))
