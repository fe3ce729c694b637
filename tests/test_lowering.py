"""Every kernel lowers to Triton for an abstract H200, on the CPU.

Interpret mode accepts things Triton rejects (non-power-of-two blocks, sort,
gather...): this catches a kernel that only works interpreted.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import lowbit_jax as lb
from lowbit_jax import sage as sage_mod

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_h200(fn, *specs) -> str:
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H200)):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "sq, sk, d, causal, granularity, smooth_q, config",
    [
        (4096, 4096, 128, False, "per_block", False, lb.sage_fwd_config(128, False, "NVIDIA H200")),
        (1000, 1000, 128, True, "per_block", False, lb.SageFwdConfig(128, 128, 8, 3)),
        (300, 700, 64, True, "per_token", True, lb.sage_fwd_config(64, True, "NVIDIA H200")),
        (77, 50, 64, False, "per_block", True, lb.SageFwdConfig(64, 64, 4, 2)),
        (256, 256, 32, False, "per_token", False, lb.SageFwdConfig(64, 64, 4, 2)),
    ],
)
def test_sage_forward_lowers_to_triton(sq, sk, d, causal, granularity, smooth_q, config):
    opts = dict(causal=causal, scale=d**-0.5, smooth_k=True, smooth_q=smooth_q,
                per_block=granularity == "per_block", implementation="pallas", interpret=False,
                config=config.fitted(sq, sk))
    q = jax.ShapeDtypeStruct((2, sq, 8, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, sk, 2, d), jnp.bfloat16)
    text = lower_for_h200(functools.partial(sage_mod._sage_forward_jit, **opts), q, kv, kv)
    # quantize Q, quantize K+V, attention: three Triton kernels
    assert text.count(TRITON_CALL) == 3
    for name in ("sage_quantize_q", "sage_quantize_kv", "sage_attention_fwd"):
        assert name in text


def test_lowering_detects_unsupported_primitive():
    """The check is real: a kernel using `round` (unsupported by the Triton lowering) fails."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.round(x_ref[...])

    def f(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    with pytest.raises(Exception):
        lower_for_h200(f, jax.ShapeDtypeStruct((16, 16), jnp.float32))
