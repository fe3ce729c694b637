"""benchmarks/paper.py --tiny: every part runs on a tiny random checkpoint and our tiny preset, writes its results
and curves, and renders into RESULTS.md's "Paper vs ours" section."""

from __future__ import annotations

import json
import math

import pytest

from pretrained_files import VARIANTS, random_weights, train_tokenizer, write_gguf


@pytest.fixture
def paper(tmp_path, monkeypatch):
    from benchmarks import paper

    monkeypatch.setattr(paper, "RESULTS_DIR", tmp_path)
    return paper


def test_tiny_run_of_every_part(paper, tmp_path):
    from benchmarks.render_results import render_paper

    tok = train_tokenizer()
    config = dict(VARIANTS["llama"], vocab_size=tok.get_vocab_size())
    model = tmp_path / "tiny.gguf"
    write_gguf(model, config, random_weights(config), tok)
    assert paper.main(["--tiny", "--model", str(model), "--name", "paper_tiny"]) == 0
    data = json.loads((tmp_path / "paper_tiny.json").read_text())
    assert set(data) == set(paper.PARTS)
    plan = paper.PLANS["tiny"]
    rows = data["thrift"]["rows"]
    assert len(rows) == len(plan.contexts) * (2 + 2 * len(plan.budgets))
    for r in rows:  # the two ends define the gap: f = 0 recovers none of it, f = 1 all
        assert math.isfinite(r["loss"])
        if r["method"] == "thrift" and r["budget"] in (0.0, 1.0):
            assert r["gap_recovered"] == pytest.approx(r["budget"])
    qat = data["qat"]
    assert set(qat["runs"]) == {"Attn-QAT", "naive backward", "16-bit"}
    assert all(len(r["grad_norms"]) == plan.qat_steps for r in qat["runs"].values())
    sage = data["sagebwd"]["runs"]
    assert len(sage) == 8 and {r["tokens_per_step"] for r in sage} == {plan.gpu_batch * plan.gpu_seq * a
                                                                      for a in plan.accums}
    assert len(data["qat-lr"]["runs"]) == 3 * len(plan.lrs)
    assert (tmp_path / "paper_tiny.png").stat().st_size > 0
    text = "\n".join(render_paper(data))
    for title in ("ThriftAttention on tiny.gguf", "Attn-QAT on tiny.gguf", "The naive backward's instability",
                  "SageBwd pretraining"):
        assert title in text
    assert text.count("\n- **") == len(paper.PARTS)  # one sentence of agreement or difference per part
    thrift_rows = [line for line in text.splitlines() if line.startswith("| 128 |") and line.count("|") == 9]
    assert len(thrift_rows) == len(plan.budgets)


def test_gpu_parts_are_skipped_on_a_cpu_with_a_line(paper, capsys):
    assert paper.main(["--quick", "--only", "sagebwd", "--name", "paper_skip"]) == 0
    assert "sagebwd: needs a GPU" in capsys.readouterr().out


def test_a_long_context_run_adds_its_rows_to_the_earlier_ones(paper):
    def part(contexts, cmd):
        return dict(model="m.gguf", windows_per_text=1, mode="quick", command=cmd, seconds=1.0,
                    rows=[dict(context=c, method="thrift", budget=0.0) for c in contexts])

    merged = paper._merged(part([1024, 2048], "first"), part([2048, 4096], "second"))
    assert [r["context"] for r in merged["rows"]] == [1024, 2048, 4096] and merged["commands"] == ["first", "second"]
    other = dict(part([1024], "other"), model="n.gguf")
    assert paper._merged(other, part([4096], "second"))["rows"] == part([4096], "")["rows"]  # another model: replaced
