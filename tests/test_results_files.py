"""benchmarks.common.keep_other_sections: a run of some parts of a benchmark keeps the others of its results file,
each with the run that measured it, and the rendered page says which run that was."""

import json

from benchmarks.common import keep_other_sections
from benchmarks.render_results import render_headline


def _env(date):
    return dict(device="GPU", jax="0.11.2", date=date, platform="gpu")


def test_a_partial_run_keeps_the_other_parts_with_their_provenance(tmp_path):
    path = tmp_path / "headline.json"
    old = dict(env=_env("2026-01-01 00:00:00"), command="headline.py", training=[], decode=[{"old": 1}],
               accuracy=[{"inputs": "normal", "method": "sage", "cos O": 0.5, "cos dQ": 0.5, "cos dK": 0.5,
                          "cos dV": 0.5}])
    path.write_text(json.dumps(old))
    new = dict(env=_env("2026-02-02 00:00:00"), command="headline.py --parts decode")
    payload = keep_other_sections(new, path, ["decode"], ("training", "decode", "accuracy"))
    assert "decode" not in payload  # the run fills its own part
    assert payload["accuracy"] == old["accuracy"] and payload["training"] == []
    assert payload["provenance"]["accuracy"]["command"] == "headline.py"
    assert payload["provenance"]["decode"]["command"] == "headline.py --parts decode"
    payload["decode"] = [dict(shape=[8, 8192], ms={"cudnn_bf16": 0.1, "thrift f=0.05": 0.08}, ratio=1.25)]
    page = "\n".join(render_headline(payload))
    assert "Parts training, accuracy from another run (2026-01-01 00:00:00): `headline.py`." in page
    assert "| 8 | 8192 | 0.100 | 0.080 | 1.25× |" in page

    path.write_text(json.dumps(payload))  # a third run of the accuracy part keeps decode's provenance
    third = keep_other_sections(dict(env=_env("2026-03-03 00:00:00"), command="headline.py --parts accuracy"),
                                path, ["accuracy"], ("training", "decode", "accuracy"))
    assert third["provenance"]["decode"]["command"] == "headline.py --parts decode"
    assert third["provenance"]["training"]["command"] == "headline.py"
