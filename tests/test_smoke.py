"""Model and training smoke tests for the fast tier: every attention method in a tiny model, one short training
run through the CLI's code path, and one interpreted case of each Mosaic GPU kernel family."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit_jax as lb
from attention_base import INTERPRET, make_qkv
from models import TransformerLM, model_config
from train.config import TrainConfig
from train.loop import train


@pytest.mark.parametrize("method", ["dense", "sage", "qat_fp4", "thrift"])
def test_tiny_model_runs_every_method(method):
    model = TransformerLM(model_config("tiny", method=method, dtype="float32"), rngs=nnx.Rngs(0))
    tokens = jnp.arange(64, dtype=jnp.int32)[None] % 256
    logits = model(tokens)
    assert logits.shape == (1, 64, 256) and np.isfinite(np.asarray(logits)).all()
    nxt, caches = model.prefill(tokens[:, :8])
    out, _ = model.decode(tokens[:, 8:9], caches)
    assert out.shape == (1, 1, 256) and np.isfinite(np.asarray(out)).all()


def test_a_short_training_run_learns_and_checkpoints(tmp_path):
    summary = train(TrainConfig(out=str(tmp_path), preset="tiny", method="sage", steps=6, batch=2, seq=32,
                                max_corpus_mb=1, eval_every=6, eval_batches=1, ckpt_every=3, warmup=1, devices=1),
                    log=lambda *_: None)
    assert summary["step"] == 6 and np.isfinite(summary["val_loss"])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "6"]


@pytest.mark.parametrize("method", ["sage", "qat"])
def test_mosaic_kernels_interpreted_match_the_reference(method):
    """One case of each Mosaic GPU kernel family, interpreted, against the xla reference (the full coverage is in
    the slow tier)."""
    q, k, v = make_qkv(1, 256, 256, 4, 2, 64, seed=3)
    if method == "sage":
        fn = lb.sage_attention
        cfg = lb.SageFwdConfig(fwd_backend="mosaic", dkdv_backend="mosaic", dq_backend="mosaic")
    else:
        fn = lb.qat_attention
        cfg = lb.QatConfig(fwd_backend="mosaic", bwd_backend="mosaic")
    outs = []
    for impl in ("pallas", "xla"):
        o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal=True, config=cfg, implementation=impl,
                                            interpret=INTERPRET and impl == "pallas"), q, k, v)
        outs.append([np.asarray(x, np.float32) for x in (o, *vjp(o))])
    for name, a, b in zip(("o", "dq", "dk", "dv"), *outs):
        assert np.abs(a - b).sum() <= 1e-3 * np.abs(b).sum(), name


def test_thrift_decode_kernel_interpreted_matches_the_reference():
    q, k, v = make_qkv(1, 2, 200, 4, 2, 64, seed=4)
    cache = lb.ThriftKVCache.create(1, 256, 2, 64).append(k, v)
    got = lb.thrift_decode(q, cache, budget=0.5, implementation="pallas", interpret=INTERPRET)
    want = lb.thrift_decode(q, cache, budget=0.5, implementation="xla")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-3)
