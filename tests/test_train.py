"""Training: data, loss decrease, exact resume, NaN guard, data parallelism, CLIs, bad configuration."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train import generate as generate_cli
from train import pretrain, qat
from train.checkpoint import Checkpoints, read_config
from train.data import ByteTokenizer, PackedBatches, load_corpus, stdlib_files, train_val_split
from train.config import ConfigError
from train.loop import TrainConfig, TrainingDiverged, build, train

# devices=4: data parallel over four of tests/conftest.py's eight host devices (batch 4 does not divide eight)
FAST = dict(preset="tiny", batch=4, seq=32, max_corpus_mb=1, eval_batches=2, lr=3e-3, warmup=2, devices=4)


def test_builtin_corpus_and_split_are_deterministic():
    assert len(stdlib_files()) > 100
    a, b = load_corpus(None, 2**20), load_corpus(None, 2**20)
    assert a.dtype == np.uint8 and a.size == 2**20 and np.array_equal(a, b)
    tr, va = train_val_split(a)
    assert tr.size + va.size == a.size and np.array_equal(va, a[-va.size:])
    text = "héllo\n"
    assert ByteTokenizer.decode(ByteTokenizer.encode(text)) == text


def test_packed_batches_depend_only_on_seed_and_step():
    tokens = np.arange(10_000) % 256
    data = PackedBatches(tokens.astype(np.uint8), seq_len=16, global_batch=4, accum=2, seed=3)
    b5 = data.batch(5)
    assert b5.shape == (2, 4, 17) and b5.dtype == np.int32
    assert np.array_equal(b5, PackedBatches(tokens.astype(np.uint8), 16, 4, 2, seed=3).batch(5))
    assert not np.array_equal(b5, data.batch(6))
    assert np.all((b5[..., 1:] - b5[..., :-1]) % 256 == 1)  # contiguous windows
    assert data.tokens_per_step == 2 * 4 * 16


def test_loss_decreases_and_resume_is_exact(tmp_path):
    cfg = dict(FAST, steps=8, eval_every=4, ckpt_every=4, method="sage")
    full = train(TrainConfig(out=str(tmp_path / "a"), **cfg), log=lambda *_: None)
    with pytest.raises(FileNotFoundError):
        Checkpoints(tmp_path / "nothing").restore(None, {})
    train(TrainConfig(out=str(tmp_path / "b"), stop_after=4, **cfg), log=lambda *_: None)  # "preempted" at 4
    resumed = train(TrainConfig(out=str(tmp_path / "b"), **cfg), log=lambda *_: None)
    assert resumed["loss"] == full["loss"] and resumed["val_loss"] == full["val_loss"]
    again = train(TrainConfig(out=str(tmp_path / "b"), **cfg), log=lambda *_: None)  # finished: nothing to do
    assert again["loss"] == full["loss"] and again["val_loss"] == full["val_loss"]
    recs_a = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    recs_b = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in recs_a] == [r["loss"] for r in recs_b]
    assert recs_a[-1]["loss"] < recs_a[0]["loss"] - 0.5  # it learns
    assert (tmp_path / "a" / "loss.png").stat().st_size > 1000
    assert "val_bits_per_byte" in recs_a[-1]


def test_nan_guard_keeps_last_good_checkpoint(tmp_path):
    cfg = TrainConfig(out=str(tmp_path), steps=8, batch=4, seq=32, lr=1e7, warmup=1, clip=1e30, ckpt_every=2,
                      eval_every=100, method="dense", max_corpus_mb=1, devices=4)
    with pytest.raises(TrainingDiverged, match="non-finite .* Last good checkpoint: step 2"):
        train(cfg, log=lambda *_: None)
    assert Checkpoints(tmp_path / "checkpoints").latest_step() == 2


@pytest.mark.parametrize("method", ["dense", "sage"])
def test_data_parallel_step_equals_single_device(method):
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces 8 host devices on CPU)")
    cfg = TrainConfig(method=method, accum=2, dtype="float32", **FAST).resolved()
    batch = jnp.asarray(PackedBatches(load_corpus(None, 2**20), 32, 4, 2, seed=0).batch(0))
    results = []
    for devices in (1, 4):
        b = build(TrainConfig(**{**cfg.__dict__, "devices": devices}))
        opt_state = b["tx"].init(b["params"])
        params, _, m = b["train_step"](b["params"], opt_state, batch)
        results.append((params, float(m["loss"]), float(m["grad_norm"])))
    (p1, l1, g1), (p4, l4, g4) = results
    assert l1 == pytest.approx(l4, rel=1e-5) and g1 == pytest.approx(g4, rel=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-5, atol=2e-6)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


_TWO_RUNS = """
import json, sys
from train.loop import TrainConfig, train
cfg = TrainConfig(**json.loads(sys.argv[1]))
train(TrainConfig(**{**cfg.__dict__, "stop_after": 2}))  # "preempted" after 2 steps
print("summary", train(cfg))  # resumed in the same processes
"""


def test_two_processes_train_and_resume_as_one(tmp_path):
    """Two jax.distributed processes (2 CPU devices each), preempted and resumed, give the losses of one
    uninterrupted 4-device process; only process 0 writes metrics, the plot and the report."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces 8 host devices on CPU)")
    cfg = dict(FAST, steps=4, eval_every=2, ckpt_every=2, method="sage")
    train(TrainConfig(out=str(tmp_path / "one"), **cfg), log=lambda *_: None)
    port = _free_port()
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]  # conftest's others
    env = {**os.environ, "XLA_FLAGS": " ".join(["--xla_force_host_platform_device_count=2", *flags]),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_RUNS, json.dumps(dict(
        cfg, out=str(tmp_path / "two"), coordinator=f"localhost:{port}", num_processes=2, process_id=i))],
        env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "on 4 device(s)" in outs[0] and "resumed from" in outs[0] and "on 4 device(s)" not in outs[1]
    assert all("summary {'step': 4" in out for out in outs)
    recs = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("one", "two")}
    assert [r["step"] for r in recs["two"]] == [1, 2, 3, 4]  # one writer, no duplicated lines
    np.testing.assert_allclose([r["loss"] for r in recs["two"]], [r["loss"] for r in recs["one"]], rtol=1e-6)
    assert recs["two"][-1]["val_loss"] == pytest.approx(recs["one"][-1]["val_loss"], rel=1e-6)


def test_ds_scale_row_reaches_sage_backward():
    """--ds-scale row: the model's sage attention gets SageFwdConfig(ds_scale="row"), which changes the
    INT8 backward's gradients (a little) but not the forward's loss."""
    batch = jnp.asarray(PackedBatches(load_corpus(None, 2**20), 32, 4, 1, seed=0).batch(0))
    results = {}
    for ds_scale in ("tile", "row"):
        b = build(TrainConfig(method="sage", ds_scale=ds_scale, dtype="float32", **FAST).resolved())
        model = nnx.merge(b["graphdef"], b["params"])
        config = model.blocks[0].attn.attention_options.get("config")
        assert (config.ds_scale if config is not None else "tile") == ds_scale
        _, _, m = b["train_step"](b["params"], b["tx"].init(b["params"]), batch)
        results[ds_scale] = (float(m["loss"]), float(m["grad_norm"]))
    (l_tile, g_tile), (l_row, g_row) = results["tile"], results["row"]
    assert l_tile == l_row
    assert g_tile != g_row and g_row == pytest.approx(g_tile, rel=0.05)


def test_remat_lowers_the_train_steps_temporary_memory():
    """--remat block / dots: the compiled data-parallel train step (sage, Pallas interpret) needs less XLA
    temporary memory than with every residual stored (on the H200 at the 50m preset: 1.55 vs 8.00 GiB)."""
    temp = {}
    for remat in ("none", "block", "dots"):
        b = build(TrainConfig(method="sage", implementation="pallas", remat=remat, **{**FAST, "devices": 1}).resolved())
        tokens = jnp.zeros((1, FAST["batch"], FAST["seq"] + 1), jnp.int32)
        step = b["train_step"].lower(b["params"], b["tx"].init(b["params"]), tokens).compile()
        temp[remat] = step.memory_analysis().temp_size_in_bytes
    assert temp["block"] < 0.8 * temp["none"] and temp["dots"] < 0.8 * temp["none"], temp


@pytest.mark.parametrize(
    "overrides, err, match",
    [
        (dict(method="flash"), ConfigError, "method: must be one of"),
        (dict(seq=1024), ValueError, "exceeds the model's max_len"),
        (dict(corpus="/no/such/corpus"), FileNotFoundError, "does not exist"),
        (dict(tokens_per_step=1000), ConfigError, "multiple of batch"),
        (dict(batch=6, devices=4), ValueError, "divisible by the number of devices"),
        (dict(steps=0), ConfigError, "steps: must be >= 1"),
        (dict(method="sage", naive_backward=True), ConfigError, "needs --method qat_fp4"),
        (dict(method="dense", ds_scale="row"), ConfigError, "needs --method sage"),
        (dict(ds_scale="token"), ConfigError, "ds_scale: must be one of"),
        (dict(remat="full"), ConfigError, "remat: must be one of"),
        (dict(method="thrift"), ConfigError, "training-free"),
        (dict(lr=float("nan")), ConfigError, "lr: must be a finite number > 0"),
        (dict(dtype="float64"), ConfigError, "dtype: must be one of"),
    ],
)
def test_bad_training_config(tmp_path, overrides, err, match):
    if overrides.get("devices", 1) > len(jax.devices()):
        pytest.skip("needs 4 devices (tests/conftest.py forces 8 host devices on CPU)")
    with pytest.raises(err, match=match):
        train(TrainConfig(out=str(tmp_path), **{**FAST, "steps": 2, **overrides}), log=lambda *_: None)


def test_cli_pretrain_qat_generate(tmp_path, capsys):
    run = tmp_path / "pre"
    assert pretrain.main(["--out", str(run), "--steps", "4", "--batch", "4", "--seq", "32", "--eval-every", "4",
                          "--max-corpus-mb", "1", "--method", "dense", "--tokens-per-step", "256", "--devices", "4"]) == 0
    assert json.loads((run / "summary.json").read_text())["step"] == 4
    assert qat.main(["--from", str(run), "--out", str(tmp_path / "qat"), "--steps", "2",
                     "--eval-every", "2", "--max-corpus-mb", "1", "--devices", "4"]) == 0
    first_qat = json.loads((tmp_path / "qat" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    first_pre = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first_qat < first_pre  # it started from the pretrained weights
    assert read_config(str(tmp_path / "qat"))["train"]["method"] == "qat_fp4"  # train.qat's default method
    capsys.readouterr()
    assert generate_cli.main(["--from", str(tmp_path / "qat"), "--prompt", "import ", "--tokens", "20",
                              "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("import ") and len(out.rstrip("\n")) >= len("import ") + 5
    assert generate_cli.main(["--from", str(run), "--prompt", "import ", "--tokens", "20", "--temperature", "0",
                              "--method", "thrift", "--budget", "0.25"]) == 0  # a dense-trained model, served in FP4
    out = capsys.readouterr().out
    assert out.startswith("import ") and len(out.rstrip("\n")) >= len("import ") + 5
    for bad in (lambda: generate_cli.main(["--from", str(run), "--method", "thrift", "--budget", "2"]),
                lambda: qat.main(["--method", "sage"])):  # argparse refuses: one line, exit 2
        with pytest.raises(SystemExit) as info:
            bad()
        assert info.value.code == 2
    assert generate_cli.main(["--from", str(tmp_path / "missing")]) == 2


def test_evaluate_scores_a_checkpoint_with_another_method(tmp_path, capsys):
    """train.evaluate: the run's validation windows, per-token losses equal to the training loop's eval loss, the
    bucket summary, a dense-trained run served with thrift beyond the preset's max_len (TrainConfig.max_len)."""
    from train import evaluate
    from train.generate import load_model, with_method

    run = tmp_path / "run"
    cfg = TrainConfig(out=str(run), **{**FAST, "steps": 2, "method": "dense", "max_len": 512})
    train(cfg, log=lambda *_: None)
    assert read_config(str(run))["model"]["max_len"] == 512  # the preset's is 256
    _, val = train_val_split(load_corpus(None, 2**20))
    windows = evaluate.validation_windows(str(run), 32, 4)
    assert windows.shape == (4, 33) and windows.dtype == np.int32
    np.testing.assert_array_equal(windows.reshape(-1), val[:132])
    model = load_model(str(run))
    losses = evaluate.token_losses(model, windows, batch=3)  # 4 windows: a last call of one
    assert losses.shape == (4, 32) and np.all(np.isfinite(losses)) and losses.min() > 0
    b = build(TrainConfig(**{**cfg.__dict__, "devices": 1}).resolved())  # the loop's eval loss, one device
    expected = float(b["eval_fn"](nnx.split(model)[1], jnp.asarray(windows)[None]))
    np.testing.assert_allclose(losses.mean(), expected, rtol=2e-3)
    summary = evaluate.summarize(losses, buckets=4)
    np.testing.assert_allclose(summary["bucket_loss"], losses.reshape(4, 4, 8).mean(axis=(0, 2)), rtol=1e-12)
    np.testing.assert_allclose(summary["bits_per_byte"], losses.mean() / np.log(2), rtol=1e-12)
    assert summary["tokens"] == 128 and len(summary["window_loss"]) == 4
    served = load_model(str(run), method="thrift", attention_options={"budget": 0.25})
    np.testing.assert_array_equal(evaluate.token_losses(with_method(model, "thrift", {"budget": 0.25}), windows,
                                                        batch=4), evaluate.token_losses(served, windows, batch=4))
    capsys.readouterr()
    assert evaluate.main(["--from", str(run), "--method", "thrift", "--budget", "0.25", "--seq", "300",
                          "--windows", "2", "--batch", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 600 and np.isfinite(out["loss"]) and len(out["bucket_loss"]) == 4
    assert evaluate.main(["--from", str(run), "--budget", "0.25"]) == 2  # a thrift option without thrift
    assert evaluate.main(["--from", str(run), "--windows", "100000"]) == 2
    assert "validation split" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="max_len: must be >= 1"):
        train(TrainConfig(out=str(tmp_path / "bad"), **{**FAST, "max_len": 0}), log=lambda *_: None)
