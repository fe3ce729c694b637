"""Flax models: shapes per method, QK-norm, RoPE, KV-cache decode, bad configuration."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.attention import Attention, rope


@pytest.mark.parametrize("method", ["dense", "sage", "qat_fp4"])
def test_output_shapes(method):
    cfg = models.model_config("tiny", method=method)
    model = models.TransformerLM(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 40), 0, 256)
    logits = model(tokens)
    assert logits.shape == (2, 40, 256) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_sage_and_dense_models_agree_closely():
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 64), 0, 256)
    outs = [models.TransformerLM(models.model_config("tiny", method=m, dtype="float32"), rngs=nnx.Rngs(0))(tokens)
            for m in ("dense", "sage")]
    a, b = (np.asarray(x).ravel() for x in outs)
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.999


def test_qat_model_is_fp4_quantized_but_close_to_dense():
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 64), 0, 256)
    outs = [models.TransformerLM(models.model_config("tiny", method=m, dtype="float32"), rngs=nnx.Rngs(0))(tokens)
            for m in ("dense", "qat_fp4")]
    a, b = (np.asarray(x).ravel() for x in outs)
    cos = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    assert 0.9 < cos < 1.0 - 1e-6  # close (random init: FP4 error is large next to tiny logits), but really FP4


def test_qat_model_gradient_and_naive_option():
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 32), 0, 256)
    cfg = models.model_config("tiny", method="qat_fp4", dtype="float32")

    def grad_norm(options):
        model = models.TransformerLM(cfg, rngs=nnx.Rngs(0), attention_options=options)
        graphdef, params = nnx.split(model)
        loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)  # noqa: E731
        return jax.tree.leaves(jax.grad(loss)(params))

    qat, naive = grad_norm({}), grad_norm({"naive_backward": True})
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in qat)
    assert any(float(jnp.max(jnp.abs(a - b))) > 0 for a, b in zip(qat, naive))


def test_qk_norm_normalizes_heads():
    attn = Attention(128, 2, 1, method="dense", rngs=nnx.Rngs(0), dtype=jnp.float32)
    x = 5.0 * jax.random.normal(jax.random.PRNGKey(2), (1, 16, 64))
    y = attn.q_norm(x)
    rms = np.sqrt(np.mean(np.asarray(y) ** 2, axis=-1))
    np.testing.assert_allclose(rms, 1.0, rtol=1e-3)  # learnable scale starts at 1
    attn.q_norm.scale.set_value(2.0 * attn.q_norm.scale.get_value())
    np.testing.assert_allclose(np.sqrt(np.mean(np.asarray(attn.q_norm(x)) ** 2, axis=-1)), 2.0, rtol=1e-3)
    assert Attention(128, 2, 1, method="dense", qk_norm=False, rngs=nnx.Rngs(0)).q_norm is None


def test_rope_is_a_relative_rotation():
    q = jax.random.normal(jax.random.PRNGKey(3), (1, 1, 1, 64))
    k = jax.random.normal(jax.random.PRNGKey(4), (1, 1, 1, 64))
    dot = lambda i, j: float(jnp.sum(rope(q, jnp.array([i]), 1e4) * rope(k, jnp.array([j]), 1e4)))  # noqa: E731
    assert dot(5, 2) == pytest.approx(dot(13, 10), rel=1e-4)
    np.testing.assert_allclose(np.linalg.norm(rope(q, jnp.array([7]), 1e4)), np.linalg.norm(q), rtol=1e-5)


@pytest.mark.parametrize("method", ["dense", "sage"])
def test_kv_cache_decode_matches_full_forward(method):
    cfg = models.model_config("tiny", method=method, dtype="float32")
    model = models.TransformerLM(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 24), 0, 256)
    full = models.TransformerLM(models.model_config("tiny", method="dense", dtype="float32"), rngs=nnx.Rngs(0))(
        tokens)
    cache = model.init_cache(2)
    logits_prefix, cache = model.decode(tokens[:, :16], cache)
    steps = [logits_prefix]
    for t in range(16, 24):
        logits, cache = model.decode(tokens[:, t:t + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(full), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(method="flash"), "attention method must be one of"),
        (dict(method="thrift"), "not available in this release"),
        (dict(num_heads=3), "num_heads"),
        (dict(num_kv_heads=3, num_heads=4, dim=256), "num_heads"),
        (dict(dim=96, num_heads=2), "head dim"),
    ],
)
def test_bad_model_config(overrides, match):
    with pytest.raises(ValueError, match=match):
        models.model_config("tiny", **overrides)


def test_unknown_preset_and_too_long_sequence():
    with pytest.raises(ValueError, match="unknown model preset"):
        models.model_config("huge")
    model = models.TransformerLM(models.model_config("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="exceeds the model's max_len"):
        model(jnp.zeros((1, 300), jnp.int32))
