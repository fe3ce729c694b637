"""KV-cache misuse is refused outside ``jit`` and defined under it: ThriftKVCache, thrift_decode and the model's
decode path (which never writes past max_len)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit_jax as lb
from attention_base import make_qkv
from models import TransformerLM, model_config

_, K, V = make_qkv(1, 1, 192, 4, 2, 64)
Q = make_qkv(1, 4, 4, 4, 2, 64)[0]


def _full():
    return lb.ThriftKVCache.create(1, 128, 2, 64).append(K[:, :128], V[:, :128])


def test_append_past_max_len_raises_outside_jit():
    with pytest.raises(ValueError, match="holding 128 of max_len 128: it would overflow"):
        _full().append(K[:, 128:], V[:, 128:])


def test_append_past_max_len_under_jit_writes_nothing_and_flags_it():
    full = _full()
    after = jax.jit(lambda c, k, v: c.append(k, v))(full, K[:, 128:], V[:, 128:])
    assert int(after.length) == 128 and bool(after.overflowed) and not bool(full.overflowed)
    for name in ("k", "v", "k4", "k4_scale", "v4", "v4_scale", "k_mean"):
        np.testing.assert_array_equal(np.asarray(getattr(after, name), np.float32),
                                      np.asarray(getattr(full, name), np.float32), err_msg=name)
    o = jax.jit(lambda q, c: lb.thrift_decode(q, c))(Q[:, :1], after)
    assert np.isnan(np.asarray(o, np.float32)).all()


@pytest.mark.parametrize("cached, new", [(0, 1), (1, 4)])
def test_decode_with_fewer_cached_than_new_tokens(cached, new):
    cache = lb.ThriftKVCache.create(1, 128, 2, 64)
    if cached:
        cache = cache.append(K[:, :cached], V[:, :cached])
    with pytest.raises(ValueError, match=f"{new} new token.* holding {cached}: append"):
        lb.thrift_decode(Q[:, :new], cache)
    o = jax.jit(lambda q, c: lb.thrift_decode(q, c))(Q[:, :new], cache)
    assert np.isnan(np.asarray(o, np.float32)).all()


def test_decode_of_zero_tokens_raises():
    with pytest.raises(ValueError, match="at least one new token"):
        lb.thrift_decode(Q[:, :0], _full())


def test_a_valid_decode_is_finite_and_unflagged():
    cache = jax.jit(lambda c, k, v: c.append(k, v))(lb.ThriftKVCache.create(1, 128, 2, 64), K[:, :100], V[:, :100])
    assert not bool(cache.overflowed)
    o = jax.jit(lambda q, c: lb.thrift_decode(q, c))(Q[:, :2], cache)
    assert np.isfinite(np.asarray(o, np.float32)).all()


@pytest.mark.parametrize("method", ["dense", "thrift"])
def test_model_decode_never_writes_past_max_len(method):
    cfg = model_config("tiny", method=method, max_len=64, dtype="float32")
    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.arange(64, dtype=jnp.int32)[None] % 256
    _, caches = model.prefill(tokens)  # full
    with pytest.raises(ValueError, match="overflow"):
        model.decode(tokens[:, :1], caches)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).decode(t, c))
    logits, after = step(state, tokens[:, :1], caches)
    assert np.isnan(np.asarray(logits)).all()
    for before, now in zip(caches, after):
        length = now.length if method == "thrift" else now["length"]
        flag = now.overflow if method == "thrift" else now["overflow"]
        assert int(length) == 64 and bool(flag)
        k_before = before.k if method == "thrift" else before["k"]
        k_now = now.k if method == "thrift" else now["k"]
        np.testing.assert_array_equal(np.asarray(k_now), np.asarray(k_before))
