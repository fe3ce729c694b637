"""Bad input fails with a clear error naming the argument, before anything compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit_jax as lb
from attention_base import make_qkv

Q, K, V = make_qkv(1, 16, 16, 4, 2, 64)


def call(q=Q, k=K, v=V, **kw):
    return lb.sage_attention(q, k, v, **kw)


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(q=Q[0]), ValueError, "q must have rank 4"),
        (dict(k=K[..., None]), ValueError, "k must have rank 4"),
        (dict(v=V[:, :8]), ValueError, "k and v must have the same shape"),
        (dict(k=jnp.concatenate([K, K]), v=jnp.concatenate([V, V])), ValueError, "batch size"),
        (dict(k=K[..., :32], v=V[..., :32]), ValueError, "head_dim of k/v"),
        (dict(q=jnp.concatenate([Q, Q[:, :, :1]], axis=2)), ValueError, "multiple of the number of k/v heads"),
        (dict(q=Q[..., :48], k=K[..., :48], v=V[..., :48]), ValueError, "head_dim must be one of"),
        (dict(q=Q.astype(jnp.int8)), TypeError, "q must be bfloat16, float16 or float32"),
        (dict(v=V.astype(jnp.float16)), TypeError, "share one dtype"),
        (dict(q=[[1.0]]), TypeError, "q must be a jax or numpy array"),
        (dict(q=Q[:, :0]), ValueError, "sequence lengths must be >= 1"),
        (dict(implementation="triton"), ValueError, "implementation must be one of"),
        (dict(scale=0.0), ValueError, "scale must be finite and positive"),
        (dict(scale=float("nan")), ValueError, "scale must be finite and positive"),
        (dict(scale=-1.0), ValueError, "scale must be finite and positive"),
        (dict(scale="big"), TypeError, "scale must be a number"),
        (dict(qk_granularity="per_channel"), ValueError, "qk_granularity must be one of"),
        (dict(causal="yes"), TypeError, "causal must be a bool"),
        (dict(config="fast"), TypeError, "config must be a SageFwdConfig"),
    ],
)
def test_bad_input(kwargs, err, match):
    with pytest.raises(err, match=match):
        call(**kwargs)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the check is about running without a GPU")
def test_pallas_on_cpu_needs_interpret():
    with pytest.raises(ValueError, match="interpret=True"):
        call(implementation="pallas")


def test_traced_scale_rejected():
    with pytest.raises(TypeError, match="static Python number"):
        jax.jit(lambda s: call(scale=s))(0.5)


def test_numpy_inputs_accepted():
    out = lb.sage_attention(np.asarray(Q, np.float32), np.asarray(K, np.float32), np.asarray(V, np.float32))
    assert out.shape == Q.shape and out.dtype == jnp.float32


def test_mosaic_interpreter_refuses_a_pool_too_small(monkeypatch):
    """A multi-warpgroup Mosaic kernel interpreted on fewer CPU threads than its warpgroups + 1 would wait forever
    (the sage dK/dV kernel on 2 threads did): it raises instead, naming the flag that fixes it."""
    from pallas_kernels import _mosaic

    q, k, v = make_qkv(1, 128, 128, 2, 2, 64)
    cfg = lb.SageFwdConfig(fwd_backend="mosaic")
    monkeypatch.setattr(_mosaic, "interpreter_threads", lambda: 2)
    with pytest.raises(RuntimeError, match="xla_force_host_platform_device_count"):
        lb.sage_attention(q, k, v, config=cfg, implementation="pallas", interpret=True)
    monkeypatch.setattr(_mosaic, "interpreter_threads", lambda: 8)  # what the tests run with (conftest)
    assert lb.sage_attention(q, k, v, config=cfg, implementation="pallas", interpret=True).shape == q.shape
