"""benchmarks/activations.py: the captured dO is the loss's gradient at each layer's attention output."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import activations
from models import ModelConfig, TransformerLM


def test_captured_do_is_the_directional_derivative_of_the_loss():
    cfg = ModelConfig(vocab_size=61, dim=128, num_layers=3, num_heads=4, num_kv_heads=2, mlp_hidden=256, max_len=32,
                      method="dense", qk_norm=False, dtype="float32")
    model = TransformerLM(cfg, rngs=nnx.Rngs(3))
    tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 32), 0, cfg.vocab_size)
    captured = activations.captured_attention(model, tokens)
    assert len(captured) == 3
    loss = jax.jit(lambda p: activations.probed_loss(model, tokens)(p)[0])
    probes = activations.zero_probes(model, tokens)
    for layer, (q, k, v, do) in enumerate(captured):
        assert q.shape == do.shape == (2, 32, 4, 32) and k.shape == v.shape == (2, 32, 2, 32)
        u = do / jnp.linalg.norm(do)  # along dO the loss rises at |dO|; along another layer's dO it would not
        step = 0.05  # the output's norm is about 90: a central difference in float32, linear at this step
        shifted = lambda sign: [p + sign * step * u if i == layer else p for i, p in enumerate(probes)]  # noqa: E731
        slope = (loss(shifted(1.0)) - loss(shifted(-1.0))) / (2 * step)
        np.testing.assert_allclose(float(slope), float(jnp.linalg.norm(do)), rtol=1e-2)
