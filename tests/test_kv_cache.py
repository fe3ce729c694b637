"""KV-cache misuse is refused outside ``jit`` and defined under it: ThriftKVCache, thrift_decode and the model's
decode path (which never writes past max_len)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit_jax as lb
from attention_base import INTERPRET, make_qkv
from lowbit_jax.thrift_reference import dequantized_cache
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


def _arrays(cache):
    """The cache's arrays as float32, the 4-bit codes as the values they decode to (a group whose scale is NaN,
    having held NaN or inf, decodes to NaN whatever its codes)."""
    out = {name: np.asarray(getattr(cache, name), np.float32) for name in
           ("k", "v", "k4_scale", "v4_scale", "k_mean", "length", "overflow")}
    k4, v4 = dequantized_cache(cache.k4, cache.k4_scale, cache.v4, cache.v4_scale, cache.block)
    return dict(out, k4=np.asarray(k4), v4=np.asarray(v4))


@pytest.mark.parametrize("block, d, dtype, cached, nonfinite", [
    (64, 128, jnp.bfloat16, 0, False), (64, 128, jnp.bfloat16, 15, False),  # a V group's last token
    (64, 128, jnp.bfloat16, 16, True),  # a group's first; a NaN key and an infinite value channel
    (64, 64, jnp.bfloat16, 40, False),  # the high nibbles (a block's second half)
    (32, 64, jnp.float32, 63, False), (128, 32, jnp.float16, 127, False),  # a block's last token; the last slot
])
def test_token_append_kernel_writes_what_the_xla_append_writes(block, d, dtype, cached, nonfinite):
    """One token by the append kernel (interpreted on the CPU, compiled on a GPU) against ThriftKVCache's XLA append:
    the same 16-bit rows, scales and 4-bit values, bit for bit (NaN where a group holds NaN or inf: its codes are
    then the backend's conversion of NaN, which decodes to NaN either way); the block mean to float rounding (its
    sum runs in another order). Tokens of N(0, 1) with a K outlier channel, so the groups'
    scales differ."""
    _, k, v = make_qkv(2, 1, 128, 2, 2, d, seed=cached)
    k = k.at[..., 3].mul(20.0)
    if nonfinite:
        k, v = k.at[0, cached, 1, 5].set(jnp.nan), v.at[1, cached, 0, 7].set(jnp.inf)
    cache = lb.ThriftKVCache.create(2, 128, 2, d, dtype=dtype, block=block)
    if cached:
        cache = cache.append(k[:, :cached], v[:, :cached], implementation="xla")
    token = (k[:, cached:cached + 1], v[:, cached:cached + 1])
    want = _arrays(cache.append(*token, implementation="xla"))
    got = _arrays(cache.append(*token, implementation="pallas", interpret=INTERPRET))
    for name in want:
        if name == "k_mean":
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_token_appends_one_by_one_equal_one_append_of_them_all():
    """70 tokens appended one at a time by the kernel hold what one XLA append of the 70 holds: each append
    re-quantizes the V group and re-averages the block it touches; the 71st past a full cache writes nothing."""
    _, k, v = make_qkv(1, 1, 71, 2, 2, 64, seed=9)
    step = jax.jit(lambda c, k, v: c.append(k, v, implementation="pallas", interpret=INTERPRET))
    cache = lb.ThriftKVCache.create(1, 70, 2, 64, block=32)  # 96 slots: 70 tokens, then 26 more fit
    for i in range(70):
        cache = step(cache, k[:, i:i + 1], v[:, i:i + 1])
    want = _arrays(lb.ThriftKVCache.create(1, 70, 2, 64, block=32).append(k[:, :70], v[:, :70], implementation="xla"))
    got = _arrays(cache)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
    full = lb.ThriftKVCache.create(1, 32, 2, 64, block=32).append(k[:, :32], v[:, :32], implementation="xla")
    after = step(full, k[:, 32:33], v[:, 32:33])
    assert bool(after.overflowed) and int(after.length) == 32
    for name, x in _arrays(full).items():
        if name != "overflow":
            np.testing.assert_array_equal(_arrays(after)[name], x, err_msg=name)
