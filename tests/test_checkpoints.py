"""Damaged checkpoints are named in one line and skipped; a run killed at any moment resumes to the same bits."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from train import generate as generate_cli
from train.checkpoint import MANIFEST, CheckpointError, Checkpoints, read_config
from train.config import TrainConfig
from train.loop import train

ROOT = Path(__file__).resolve().parent.parent
RUN = dict(preset="tiny", method="dense", batch=2, seq=32, max_corpus_mb=1, eval_batches=1, eval_every=100,
           lr=3e-3, warmup=2, devices=1)


def _state_arrays(run: Path, step: int) -> list[np.ndarray]:
    tree = ocp.StandardCheckpointer().restore((run / "checkpoints" / str(step) / "state").absolute())
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ckpt") / "base"
    train(TrainConfig(out=str(run), steps=4, ckpt_every=2, **RUN), log=lambda *_: None)
    return run


def _files_of_each_kind(step_dir: Path) -> dict[str, Path]:
    data = sorted(p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d")
    return {"array data": data[0], "state/_METADATA": step_dir / "state" / "_METADATA",
            "state/manifest.ocdbt": step_dir / "state" / "manifest.ocdbt",
            "config/metadata": step_dir / "config" / "metadata",
            "_CHECKPOINT_METADATA": step_dir / "_CHECKPOINT_METADATA", "manifest": step_dir / MANIFEST}


@pytest.mark.parametrize("kind", ["array data", "state/_METADATA", "state/manifest.ocdbt", "config/metadata",
                                  "_CHECKPOINT_METADATA", "manifest"])
def test_each_kind_of_damaged_file_is_named_and_skipped(base_run, tmp_path, kind):
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    path = _files_of_each_kind(run / "checkpoints" / "4")[kind]
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])  # truncated
    ckpts = Checkpoints(run / "checkpoints")
    like = {"params": None}
    with pytest.raises(CheckpointError) as info:
        ckpts.restore(4, like)
    message = str(info.value)
    assert "\n" not in message and str(run / "checkpoints") in message and "step 4" in message
    assert str(path.relative_to(run / "checkpoints" / "4")) in message
    warnings = []
    ckpts.close()
    # training resumes from step 2, with one warning line, and the damaged step kept aside
    summary = train(TrainConfig(out=str(run), steps=6, ckpt_every=2, **RUN), log=warnings.append)
    assert summary["step"] == 6
    assert any("step 4 is damaged" in w and "skipping" in w for w in warnings)
    assert any("resumed from" in w and "at step 2" in w for w in warnings)
    assert list((run / "checkpoints-damaged").iterdir())[0].name.startswith("4-")
    assert read_config(run)["train"]["steps"] == 6


def test_resume_past_a_damaged_step_gives_the_uninterrupted_run(base_run, tmp_path):
    whole, damaged = tmp_path / "whole", tmp_path / "damaged"
    train(TrainConfig(out=str(whole), steps=6, ckpt_every=2, **RUN), log=lambda *_: None)
    shutil.copytree(base_run, damaged)
    data = _files_of_each_kind(damaged / "checkpoints" / "4")["array data"]
    data.write_bytes(b"\0" * data.stat().st_size)  # same size, other bytes
    train(TrainConfig(out=str(damaged), steps=6, ckpt_every=2, **RUN), log=lambda *_: None)
    for a, b in zip(_state_arrays(whole, 6), _state_arrays(damaged, 6), strict=True):
        np.testing.assert_array_equal(a, b)
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in
             (damaged / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))  # the retrained steps' old records went


def test_loaders_warn_and_fall_back_or_fail_in_one_line(base_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    meta = run / "checkpoints" / "4" / "state" / "_METADATA"
    meta.write_bytes(meta.read_bytes()[:40])
    assert generate_cli.main(["--from", str(run), "--tokens", "3", "--temperature", "0"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step 4 is damaged: state/_METADATA" in err[0]
    for step in ("2",):  # every step damaged: one error line, exit 2
        meta = run / "checkpoints" / step / "state" / "_METADATA"
        meta.write_bytes(meta.read_bytes()[:40])
    assert generate_cli.main(["--from", str(run), "--tokens", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: no intact checkpoint in") and len(err) == 3  # two warnings, one error


@contextlib.contextmanager
def _sigint(handler):
    """SIGINT handled by ``handler`` inside (the suite may run with it ignored: started in the background)."""
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _pretrain(out: Path, steps: int) -> subprocess.Popen:
    flags = ["--out", str(out), "--steps", str(steps), "--ckpt-every", "10", "--eval-every", "1000"]
    for name in ("preset", "method", "batch", "seq", "max_corpus_mb", "eval_batches", "lr", "warmup", "devices"):
        flags += ["--" + name.replace("_", "-"), str(RUN[name])]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # SIGINT as a terminal gives it: a suite started in the background by a script runs with SIGINT ignored, which a
    # child would inherit (and then have no KeyboardInterrupt); a handler, unlike an ignored signal, resets on exec
    with _sigint(signal.default_int_handler):
        return subprocess.Popen([sys.executable, "-m", "train.pretrain", *flags], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kill_inside_a_save(proc: subprocess.Popen, ckpt_dir: Path, timeout: float = 120) -> bool:
    """SIGKILL ``proc`` as soon as Orbax's temporary directory of a save appears; False if none did."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if ckpt_dir.exists() and any("tmp" in p.name for p in ckpt_dir.iterdir()):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.0005)
    return False


def _kill_past(proc: subprocess.Popen, ckpt_dir: Path, step: int, delay: float, timeout: float = 120) -> None:
    """SIGKILL ``proc`` ``delay`` seconds after its checkpoint of ``step`` or a later one appears (by progress, not
    by the clock: a fast or a loaded machine kills at the same point of the run)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if max((int(p.name) for p in ckpt_dir.glob("*") if p.name.isdigit()), default=-1) >= step:
            break
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)


def test_sigkill_at_random_moments_then_resume_is_bit_identical(tmp_path):
    steps = 200
    whole = _pretrain(tmp_path / "whole", steps)
    assert whole.wait(timeout=300) == 0, whole.stderr.read()
    run, rng, kills, in_save = tmp_path / "killed", random.Random(0), 0, 0
    while True:
        proc = _pretrain(run, steps)
        if kills == 1:  # one kill inside a save, the others at random moments of the run's second to last third
            in_save += _kill_inside_a_save(proc, run / "checkpoints")
        elif kills < 4:
            _kill_past(proc, run / "checkpoints", 10 * rng.randint(2 + 4 * kills, 4 + 4 * kills), rng.uniform(0, 0.05))
        rc = proc.wait(timeout=300)
        if rc == 0:
            break
        assert rc == -signal.SIGKILL, proc.stderr.read()
        kills += 1
    assert kills >= 3 and in_save == 1
    for a, b in zip(_state_arrays(tmp_path / "whole", steps), _state_arrays(run, steps), strict=True):
        np.testing.assert_array_equal(a, b)


def test_ctrl_c_prints_one_line_and_exits_130(tmp_path):
    proc = _pretrain(tmp_path / "run", 100_000)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "run" / "checkpoints" / "10").exists() and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # a run that ignored the signal must not train on under the rest of the suite
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130
    assert "Traceback" not in err and "terminate called" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted at step ") and last.endswith("rerun the same command to resume")


def _sigint_in_the_wait(ckpts: Checkpoints, monkeypatch) -> None:
    """A SIGINT sent to this process while ``ckpts`` waits for a write."""
    wait = ckpts.manager.wait_until_finished

    def interrupted_wait():
        os.kill(os.getpid(), signal.SIGINT)
        wait()

    monkeypatch.setattr(ckpts.manager, "wait_until_finished", interrupted_wait)


def test_ctrl_c_during_a_save_commits_the_step_then_interrupts(tmp_path, monkeypatch):
    """A SIGINT while orbax waits for the write (where it would log a traceback and drop the step) takes effect
    after the step is committed with its manifest."""
    ckpts = Checkpoints(tmp_path / "checkpoints")
    _sigint_in_the_wait(ckpts, monkeypatch)
    with _sigint(signal.default_int_handler), pytest.raises(KeyboardInterrupt):
        ckpts.save(3, {"w": np.arange(4.0)}, {"note": "x"})
    monkeypatch.undo()  # close() waits too
    assert ckpts.steps() == [3] and (ckpts.step_dir(3) / MANIFEST).is_file()
    ckpts.close()


def test_an_ignored_sigint_stays_ignored_during_a_save(tmp_path, monkeypatch):
    """Where SIGINT is ignored (a job a script started in the background), a save neither turns it into an
    interrupt nor leaves another handler behind."""
    ckpts = Checkpoints(tmp_path / "checkpoints")
    _sigint_in_the_wait(ckpts, monkeypatch)
    with _sigint(signal.SIG_IGN):
        ckpts.save(3, {"w": np.arange(4.0)}, {"note": "x"})
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    monkeypatch.undo()
    assert ckpts.steps() == [3] and (ckpts.step_dir(3) / MANIFEST).is_file()
    ckpts.close()
