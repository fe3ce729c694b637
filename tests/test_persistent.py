"""Persistent launches of the Mosaic GPU kernels (``_mosaic.WorkItems``), in the Mosaic GPU interpreter.

``_mosaic.PERSISTENT`` is a probe switch, off (slower on the H200: benchmarks/NOTES.md, forty-ninth session);
these tests switch it on and off. With it, a non-causal kernel whose pipeline length is a multiple of its stages
runs with one CTA per SM, each looping over work items as one pipeline of pipelines. Interpreted, three CTAs
(``_mosaic.INTERPRET_CTAS``) share the items unevenly (e.g. 16 items: 6, 5, 5), so a CTA's first (START), middle
(STEADY) and last (STOP) items all run. The values must equal the one-CTA-per-item launch's bit for bit: the items
do the same arithmetic, and the interpreted fused dQ sums a float32 slot per key block and warpgroup in a fixed
order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit_jax as lb
from attention_base import cotangent, make_qkv, metrics, vjp_outputs


def _run_both(monkeypatch, fn):
    """``fn()`` with persistent launches and with one CTA per item; the :class:`WorkItems` each launch planned."""
    from pallas_kernels import _mosaic

    plans, real = [], _mosaic.WorkItems.run
    monkeypatch.setattr(_mosaic.WorkItems, "run", lambda self, *a, **kw: plans.append(self) or real(self, *a, **kw))
    outs = {}
    for persistent in (True, False):
        monkeypatch.setattr(_mosaic, "PERSISTENT", persistent)
        jax.clear_caches()
        plans.clear()
        outs[persistent] = [np.asarray(x, np.float32) for x in fn()]
        outs[persistent, "plans"] = list(plans)
    return outs


def _assert_same(outs, names):
    for name, a, b in zip(names, outs[True], outs[False]):
        np.testing.assert_array_equal(a, b, err_msg=name)


SAGE = lb.SageFwdConfig(block_q=64, block_k=128, dkdv_backend="mosaic", dq_backend="mosaic", fwd_backend="mosaic")
QAT = lb.QatConfig(fwd_backend="mosaic", bwd_backend="mosaic")


@pytest.mark.parametrize("method, d", [("sage", 64), ("qat", 128)])
def test_persistent_forward_equals_one_cta_per_item(monkeypatch, method, d):
    """The forwards (ragged Sq, GQA): O and the row outputs equal; 16 items on 3 CTAs (4 heads × 2 query
    blocks × batch 2)."""
    from lowbit_jax import qat as qat_mod

    q, k, v = make_qkv(2, 200, 256, 4, 2, d, dtype=jnp.bfloat16, seed=d + 5, k_outlier=2.0)
    if method == "sage":
        fn = lambda: lb.sage_forward(q, k, v, implementation="pallas", interpret=True, config=SAGE)[:2]  # noqa: E731
        names = ("o", "lse")
    else:
        opts = qat_mod.resolve_qat_options(q, k, v, causal=False, naive_backward=False, implementation="pallas",
                                           interpret=True, config=QAT)
        fn = lambda: qat_mod.qat_forward(q, k, v, opts=opts, with_aux=True)[:4]  # noqa: E731
        names = ("o", "o_aux", "lse", "m")
    outs = _run_both(monkeypatch, fn)
    fwd_plans = [p for p in outs[True, "plans"] if p.names[1] == "q"]
    assert fwd_plans and all(p.ctas == 3 and int(np.prod(p.grid)) == 16 for p in fwd_plans), fwd_plans
    assert all(p.ctas is None for p in outs[False, "plans"])
    _assert_same(outs, names)


@pytest.mark.parametrize("method, d, stages_d64", [("sage", 128, None), ("qat", 64, 2)])
def test_persistent_backward_equals_one_cta_per_item(monkeypatch, method, d, stages_d64):
    """The fused dK/dV/dQ backwards (GQA, batch 2; 8 items of (kv head, 128-key block, batch) on 3 CTAs): o and
    the gradients equal, and stay within the usual tolerance of the xla twin. At head dim 64 the query tiles'
    three stages do not divide the 8 steps, so the kernel would launch one CTA per item: two stages there."""
    from pallas_kernels import qat_bwd_mosaic, sage_bwd_mosaic

    mod = sage_bwd_mosaic if method == "sage" else qat_bwd_mosaic
    if stages_d64 is not None:
        monkeypatch.setattr(mod, "STAGES_D64", stages_d64)
    q, k, v = make_qkv(2, 256, 256, 4, 2, d, dtype=jnp.bfloat16, seed=d + 9, k_outlier=2.0)
    do = cotangent(q)
    if method == "sage":
        attention = lambda *a: lb.sage_attention(*a, implementation="pallas", interpret=True,  # noqa: E731
                                                 qk_granularity="per_block", config=SAGE)
    else:
        attention = lambda *a: lb.qat_attention(*a, implementation="pallas", interpret=True, config=QAT)  # noqa: E731
    outs = _run_both(monkeypatch, lambda: vjp_outputs(attention, q, k, v, do))
    bwd_plans = [p for p in outs[True, "plans"] if p.names[1] == "kv"]
    assert bwd_plans and all(p.ctas == 3 and int(np.prod(p.grid)) == 8 for p in bwd_plans), bwd_plans
    _assert_same(outs, ("o", "dq", "dk", "dv"))
    if method == "sage":
        ref = vjp_outputs(lambda *a: lb.sage_attention(*a, implementation="xla", qk_granularity="per_block",
                                                       config=SAGE), q, k, v, do)
    else:
        ref = vjp_outputs(lambda *a: lb.qat_attention(*a, implementation="xla", config=lb.QatConfig()), q, k, v, do)
    for name, a, r in zip(("o", "dq", "dk", "dv"), outs[True], ref):
        assert metrics(a, r)[1] < 2e-3, name


def test_work_items_plan(monkeypatch):
    """Persistent only with the switch on, where Mosaic GPU's pipeline of pipelines applies (static length, a
    multiple of the stages: not causal) and every CTA gets at least two items."""
    from pallas_kernels import _mosaic
    from pallas_kernels._mosaic import DEFAULT_SMS, WorkItems

    grid, names = (32, 32, 4), ("heads", "kv", "batch")
    monkeypatch.setattr(_mosaic, "PERSISTENT", False)
    assert WorkItems.plan(grid, names, steps=64, stages=2, causal=False, interpret=False).ctas is None
    monkeypatch.setattr(_mosaic, "PERSISTENT", True)
    plan = WorkItems.plan(grid, names, steps=64, stages=2, causal=False, interpret=False)
    assert plan.ctas == DEFAULT_SMS and plan.launch_grid == ((DEFAULT_SMS,), ("cta",))
    for change in (dict(causal=True), dict(steps=63), dict(steps=jnp.int32(64))):
        kw = dict(steps=64, stages=2, causal=False, interpret=False) | change
        assert WorkItems.plan(grid, names, **kw).ctas is None, change
    small = WorkItems.plan((8, 2, 1), names, steps=64, stages=2, causal=False, interpret=False)
    assert small.ctas is None and small.launch_grid == ((8, 2, 1), names)
    assert WorkItems.plan((2, 2, 2), names, steps=4, stages=2, causal=False, interpret=True).ctas == 3
    assert WorkItems.plan((5, 1, 1), names, steps=4, stages=2, causal=False, interpret=True).ctas is None
