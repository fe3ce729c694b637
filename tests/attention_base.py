"""Shared test base for every attention method and backend.

A method's tests subclass :class:`AttentionTestBase` and set ``method`` (a
callable with the library's signature); the base supplies inputs, the exact
float64 oracle and the comparisons. On CPU the "pallas" implementation runs in
interpret mode; on a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._triton import on_gpu

INTERPRET = not on_gpu()


def make_qkv(b, sq, sk, hq, hkv, d, dtype=jnp.bfloat16, seed=0, k_outlier=0.0, q_heavy_tail=False):
    """Fresh random q (B,Sq,Hq,D), k, v (B,Sk,Hkv,D); optional K channel-mean outliers."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, sq, hq, d))
    if q_heavy_tail:
        q = rng.standard_t(3, (b, sq, hq, d))
    k = rng.standard_normal((b, sk, hkv, d))
    if k_outlier:
        k = k + k_outlier * rng.standard_normal((b, 1, hkv, d))
    v = rng.standard_normal((b, sk, hkv, d))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def cotangent(q, seed=1):
    """A fresh random dO with q's shape and dtype."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(q.shape), q.dtype)


def vjp_outputs(attention, q, k, v, do, *, f32=False):
    """(o, dq, dk, dv): attention(q, k, v) and its pullback of ``do``; ``f32`` casts all four first."""
    if f32:
        q, k, v, do = (x.astype(jnp.float32) for x in (q, k, v, do))
    o, vjp = jax.vjp(attention, q, k, v)
    return (o, *vjp(do))


def trace_stage_waits(monkeypatch, out_owner, attention, q, k, v) -> list:
    """The fused dQ's stage protocol of a Mosaic backward, from tracing ``attention``'s vjp (nothing runs): a log of
    ``("free", pending)`` per ``reduce_add.stage_free`` and ``("out", waited)`` per reduce-add made through
    ``out_owner.reduce_add_out`` (logged once its own wait, if any, has run)."""
    from pallas_kernels import reduce_add

    events = []
    real_free, real_out = reduce_add.stage_free, out_owner.reduce_add_out
    monkeypatch.setattr(reduce_add, "stage_free",
                        lambda pending=0: events.append(("free", pending)) or real_free(pending))
    monkeypatch.setattr(out_owner, "reduce_add_out", lambda *a, waited=False, **kw: (
        real_out(*a, waited=waited, **kw) or events.append(("out", waited))))
    jax.clear_caches()
    jax.make_jaxpr(lambda *x: jax.vjp(attention, *x)[1](cotangent(q)))(q, k, v)
    return events


def shard_map_grads(attention, q, k, v):
    """Gradients of sum(attention(q, k, v)²) w.r.t. q, k, v: (inside jax.shard_map over a 4-device
    batch mesh, on one device), both jitted. Skips the test without 4 devices."""
    import pytest
    from jax.sharding import Mesh, PartitionSpec

    devices = jax.devices()[:4]
    if len(devices) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces 8 host devices on CPU)")
    mesh = Mesh(np.array(devices), ("data",))
    grad = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    spec = PartitionSpec("data")
    sharded = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3, check_vma=False))
    return sharded(q, k, v), jax.jit(grad)(q, k, v)


def exact_attention_f64(q, k, v, causal=False, scale=None):
    """Softmax attention in numpy float64, bottom-right causal; rows seeing no key are zeros."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    k = np.repeat(k, hq // hkv, axis=2)
    v = np.repeat(v, hq // hkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        mask = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
        s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    p = p / np.where(l == 0, 1.0, l)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def metrics(x, ref):
    x = np.asarray(x, np.float64).ravel()
    ref = np.asarray(ref, np.float64).ravel()
    cos = float(x @ ref / (np.linalg.norm(x) * np.linalg.norm(ref)))
    rel_l1 = float(np.abs(x - ref).sum() / np.abs(ref).sum())
    return cos, rel_l1


class AttentionTestBase:
    """Subclass and define ``run(q, k, v, **options)`` returning the attention output."""

    interpret = INTERPRET
    #: accuracy a method must reach against exact attention on N(0,1) inputs
    min_cos = 0.999
    max_rel_l1 = 0.03

    def run(self, q, k, v, **options):  # pragma: no cover - abstract
        raise NotImplementedError

    def assert_close_to_exact(self, out, q, k, v, causal=False, min_cos=None, max_rel_l1=None):
        ref = exact_attention_f64(q, k, v, causal=causal)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
        cos, rel = metrics(out, ref)
        assert cos >= (min_cos or self.min_cos), f"cos-sim {cos:.6f}"
        assert rel <= (max_rel_l1 or self.max_rel_l1), f"rel-L1 {rel:.5f}"
        return cos, rel

    # Cases every method must pass: (B, Sq, Sk, Hq, Hkv, D, causal)
    AWKWARD_CASES = [
        (1, 100, 77, 4, 2, 64, True),     # ragged, GQA, causal with Sq > Sk (empty rows)
        (2, 128, 128, 2, 2, 128, False),  # aligned, D128
        (1, 70, 200, 4, 1, 64, False),    # MQA, Sk > Sq, ragged
        (1, 96, 160, 2, 2, 128, True),    # causal chunked-prefill shape (Sk > Sq)
    ]

    def check_awkward_case(self, case, dtype=jnp.bfloat16, seed=0, **options):
        b, sq, sk, hq, hkv, d, causal = case
        q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype=dtype, seed=seed)
        out = self.run(q, k, v, causal=causal, **options)
        return self.assert_close_to_exact(out, q, k, v, causal=causal)
