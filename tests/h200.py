"""Lowering the kernels for an abstract H200 on any machine (no GPU): what the lowering tests inspect."""

from __future__ import annotations

from collections.abc import Callable

import jax

#: the GPU the kernels are lowered for on a machine without one 
H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)


def lower_for_h200(fn: Callable, *specs) -> jax.stages.Lowered:
    """``jax.jit(fn)`` lowered for an abstract H200 (CUDA), on any machine: no GPU needed."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H200)):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))


def lower_mosaic_fwd_bwd(method: str, head_dim: int, causal: bool, *, dq_kernel: str | None = None,
                         seq: int = 512, **config) -> jax.stages.Lowered:
    """One jitted fwd+bwd (gradients of a scalar loss w.r.t. q, k, v) of ``method`` ("sage" or "qat") with every
    kernel on Mosaic GPU, lowered for an abstract H200 (:func:`lower_for_h200`): bf16 q (2, seq, 8, head_dim), k and
    v with 2 heads, the library's H200 config for (head_dim, causal), ``dq_kernel`` and the ``config`` fields
    replaced if given. Lowering runs
    the Python half of Mosaic GPU's compiler, so a spy on it sees each kernel's lowering."""
    import dataclasses

    import jax.numpy as jnp

    import lowbit_jax as lb
    from lowbit_jax import qat as qat_mod
    from lowbit_jax import sage as sage_mod

    q = jax.ShapeDtypeStruct((2, seq, 8, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, seq, 2, head_dim), jnp.bfloat16)
    zeros = [jnp.zeros(x.shape, x.dtype) for x in (q, kv, kv)]
    dq = dict(config) if dq_kernel is None else dict(config, dq_kernel=dq_kernel)
    # options resolved as for interpret mode (this machine may have no GPU), then compiled for the GPU
    if method == "sage":
        config = dataclasses.replace(lb.sage_fwd_config(head_dim, causal, "NVIDIA H200"), fwd_backend="mosaic",
                                     dkdv_backend="mosaic", dq_backend="mosaic", **dq)
        opts = sage_mod.resolve_options(*zeros, causal=causal, scale=None, smooth_k=True, smooth_q=False,
                                        qk_granularity="per_block", implementation="pallas", interpret=True,
                                        config=config)
        attend = lambda q, k, v, opts: sage_mod._sage_attention(q, k, v, None, opts)  # noqa: E731
    elif method == "qat":
        config = dataclasses.replace(lb.qat_config(head_dim, causal, "NVIDIA H200"), fwd_backend="mosaic",
                                     bwd_backend="mosaic", **dq)
        opts = qat_mod.resolve_qat_options(*zeros, causal=causal, naive_backward=False, implementation="pallas",
                                           interpret=True, config=config)
        attend = lambda q, k, v, opts: qat_mod._qat_attention(q, k, v, None, opts)  # noqa: E731
    else:
        raise ValueError(f"method must be 'sage' or 'qat', got {method!r}")
    opts = dataclasses.replace(opts, interpret=False)

    def grads(q, k, v):
        loss = lambda q, k, v: jnp.sum(attend(q, k, v, opts).astype(jnp.float32))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return lower_for_h200(grads, q, kv, kv)
