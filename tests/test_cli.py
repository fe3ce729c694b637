"""The command-line tools: every flag explained, nonsense refused in one line naming the flag (exit 2) before
anything is built."""

from __future__ import annotations

import shutil

import pytest

from train import evaluate, generate, pretrain, qat
from train.config import TrainConfig
from train.loop import train

TINY = dict(preset="tiny", method="dense", batch=2, seq=32, max_corpus_mb=1, eval_batches=1, eval_every=100,
            warmup=1, devices=1)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("cli") / "run"
    train(TrainConfig(out=str(run), steps=2, ckpt_every=2, **TINY), log=lambda *_: None)
    return run


def _exit(main, argv, capsys) -> tuple[int, list[str]]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("main", [pretrain.main, qat.main, generate.main, evaluate.main])
def test_help_explains_every_flag(main, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    flags = [line.split()[0] for line in out.splitlines() if line.strip().startswith("--")]
    assert len(flags) >= 4
    for line in out.split("\n  --")[1:]:  # each flag's entry: a meaning, not only its default
        text = " ".join(line.split()[1:])
        assert len(text.replace("default:", "").split()) >= 3, line


@pytest.mark.parametrize("argv, flag", [
    (["--lr", "-1"], "--lr"), (["--lr", "nan"], "--lr"), (["--lr", "0"], "--lr"), (["--dtype", "float64"], "--dtype"),
    (["--dtype", "garbage"], "--dtype"), (["--steps", "0"], "--steps"), (["--batch", "-2"], "--batch"),
    (["--seq", "0"], "--seq"), (["--method", "thrift"], "--method"), (["--warmup", "-1"], "--warmup"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio"), (["--clip", "inf"], "--clip"), (["--qk-norm", "maybe"], "--qk-norm"),
    (["--tokens-per-step", "100"], "--tokens-per-step"), (["--naive-backward", "true"], "--naive-backward"),
])
def test_pretrain_refuses_nonsense_in_one_line(argv, flag, tmp_path, capsys):
    code, err = _exit(pretrain.main, ["--out", str(tmp_path / "x"), *argv], capsys)
    assert code == 2 and len(err) == 1 and f"argument {flag}" in err[0], err
    assert not (tmp_path / "x").exists()  # nothing was started


@pytest.mark.parametrize("argv, flag", [
    (["--tokens", "0"], "--tokens"), (["--temperature", "-1"], "--temperature"), (["--top-k", "-1"], "--top-k"),
    (["--budget", "2", "--method", "thrift"], "--budget"), (["--method", "flash"], "--method"),
])
def test_generate_refuses_nonsense(tiny_run, argv, flag, capsys):
    code, err = _exit(generate.main, ["--from", str(tiny_run), *argv], capsys)
    assert code == 2 and len(err) == 1 and f"argument {flag}" in err[0], err


def test_generate_top_k_zero_samples_the_whole_distribution(tiny_run, capsys):
    assert generate.main(["--from", str(tiny_run), "--tokens", "4", "--top-k", "0", "--prompt", "ab"]) == 0
    assert capsys.readouterr().out.startswith("ab")


@pytest.mark.parametrize("argv, flag", [(["--seq", "0"], "--seq"), (["--windows", "0"], "--windows"),
                                        (["--batch", "0"], "--batch"), (["--buckets", "0"], "--buckets")])
def test_evaluate_refuses_nonsense(tiny_run, argv, flag, capsys):
    code, err = _exit(evaluate.main, ["--from", str(tiny_run), *argv], capsys)
    assert code == 2 and len(err) == 1 and f"argument {flag}" in err[0], err


def test_qat_needs_from_and_a_matching_preset(tiny_run, tmp_path, capsys):
    code, err = _exit(qat.main, [], capsys)
    assert code == 2 and len(err) == 1 and "--from" in err[0]
    code, err = _exit(qat.main, ["--from", str(tiny_run), "--preset", "small", "--out", str(tmp_path / "q")], capsys)
    assert code == 2 and len(err) == 1 and "argument --preset" in err[0] and "does not match" in err[0], err
    resumed = tmp_path / "resumed"
    shutil.copytree(tiny_run, resumed)
    code, err = _exit(pretrain.main, ["--out", str(resumed), "--preset", "small"], capsys)
    assert code == 2 and len(err) == 1 and "argument --preset" in err[0], err
