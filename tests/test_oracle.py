"""The methods against the independent float64 oracles of docs/spec.md (tests/oracle/): the references (xla) and
the kernels (Pallas, interpreted on the CPU), each compared with the oracle on its own.

Forward: the oracle runs the same quantization, so after rounding it to the output's bf16 the two agree except for
an occasional code at a rounding midpoint (float32 against float64 scores): rel-L1 ≤ 2e-4 (measured ≤ 3e-5; a wrong
scale, mask or block moves it past 1e-2). Gradients: against the exact attention gradient of the float64 oracle,
with cos-sim floors a little under the measured quantization error (with K channel outliers, no smoothing for
Attn-QAT: SageBwd 0.9992–0.9998, Attn-QAT 0.945–0.966, Thrift's O at budget 0.25 0.976).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit_jax as lb
from attention_base import INTERPRET
from lowbit_jax import sage as sage_mod
from lowbit_jax.sage_backends import SageCall, forward_for
from oracle import exact, quantized

#: (B, Sq, Sk, Hq, Hkv, D, causal): ragged, GQA, causal with Sq ≠ Sk, both head dims
CASES = [(1, 200, 256, 4, 2, 64, True), (1, 128, 128, 2, 2, 128, False), (2, 100, 300, 4, 1, 64, True)]


def _inputs(case, seed=0):
    b, sq, sk, hq, hkv, d, _ = case
    rng = np.random.default_rng(seed + sq + sk + d)
    q = rng.standard_normal((b, sq, hq, d))
    k = rng.standard_normal((b, sk, hkv, d)) + 2.0 * rng.standard_normal((b, 1, hkv, d))  # K channel outliers
    v = rng.standard_normal((b, sk, hkv, d))
    do = rng.standard_normal((b, sq, hq, d))
    return tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, do))


def _f64(*xs):
    return tuple(np.asarray(x, np.float64) for x in xs)


def _rel_l1(x, ref) -> float:
    return float(np.abs(np.asarray(x, np.float64) - ref).sum() / np.abs(ref).sum())


def _impls():
    return [pytest.param("xla", id="xla"), pytest.param("pallas", id="pallas")]


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("per_block", [True, False])
@pytest.mark.parametrize("pv_format", ["int8", "e4m3"])
def test_sage_forward_is_the_oracles(impl, case, per_block, pv_format):
    q, k, v, _ = _inputs(case)
    cfg = lb.SageFwdConfig(block_q=64, block_k=64, pv_format=pv_format)
    got = lb.sage_attention(q, k, v, causal=case[6], qk_granularity="per_block" if per_block else "per_token",
                            implementation=impl, interpret=INTERPRET and impl == "pallas", config=cfg)
    want = quantized.bf16(quantized.sage_forward(*_f64(q, k, v), causal=case[6], block_q=64, block_k=64,
                                                 per_block=per_block, pv_format=pv_format))
    assert _rel_l1(got, want) <= 2e-4


@pytest.mark.parametrize("case", [CASES[1], (1, 128, 200, 4, 2, 64, True)])
def test_mosaic_e4m3_forward_is_the_oracles(case):
    """The Mosaic GPU forward's FP8 P·V (two-level accumulation, P̃ at the running max), interpreted."""
    q, k, v, _ = _inputs(case)
    cfg = lb.SageFwdConfig(block_q=64, block_k=64, pv_format="e4m3", fwd_backend="mosaic")
    opts = sage_mod.resolve_options(q, k, v, causal=case[6], implementation="pallas", interpret=INTERPRET, config=cfg)
    assert forward_for(SageCall.of_inputs(q, k, opts)).name == "mosaic"
    got = lb.sage_attention(q, k, v, causal=case[6], implementation="pallas", interpret=INTERPRET, config=cfg)
    want = quantized.bf16(quantized.sage_forward(*_f64(q, k, v), causal=case[6], block_q=64, block_k=64,
                                                 pv_format="e4m3"))
    assert _rel_l1(got, want) <= 2e-4


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("case", CASES)
def test_qat_forward_is_the_oracles(impl, case):
    q, k, v, _ = _inputs(case)
    got = lb.qat_attention(q, k, v, causal=case[6], implementation=impl, interpret=INTERPRET and impl == "pallas",
                           config=lb.QatConfig(block_k=64))
    want = quantized.bf16(quantized.qat_forward(*_f64(q, k, v), causal=case[6], block_k=64))
    assert _rel_l1(got, want) <= 2e-4


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("method, floors", [("sage", (0.9995, 0.998, 0.998, 0.9995)),
                                            ("sage_e4m3", (0.999, 0.998, 0.998, 0.9995)),
                                            ("qat", (0.955, 0.93, 0.95, 0.955)),
                                            ("thrift", (0.97, 0.9999, 0.9999, 0.9999))])
@pytest.mark.parametrize("impl", _impls())
def test_gradients_follow_exact_attentions(method, floors, impl):
    """O and the gradients against exact attention (the float64 oracle's analytic gradient): cos-sim at least the
    measured quantization error's floor (thrift's gradient is exact attention's, straight-through)."""
    case = CASES[0]
    q, k, v, do = _inputs(case, seed=1)
    e4m3 = lb.SageFwdConfig(pv_format="e4m3")
    fn = {"sage": lb.sage_attention, "qat": lb.qat_attention,
          "sage_e4m3": lambda *a, **kw: lb.sage_attention(*a, config=e4m3, **kw),
          "thrift": lambda *a, **kw: lb.thrift_attention(*a, budget=0.25, **kw)}[method]
    kw = dict(causal=case[6], implementation=impl, interpret=INTERPRET and impl == "pallas")
    o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
    got = (o, *vjp(do))
    qn, kn, vn, don = _f64(q, k, v, do)
    want = (exact.attention(qn, kn, vn, causal=case[6]), *exact.attention_grads(qn, kn, vn, don, causal=case[6]))
    for name, g, w, floor in zip(("o", "dq", "dk", "dv"), got, want, floors):
        assert _cos(g, w) >= floor, (name, _cos(g, w))
