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


def test_the_schedule_tables_render_each_variant_against_the_default():
    """render_results: benchmarks/dq_schedule.py's rows (speed relative to the default, cuDNN beside it, the variants'
    gradient check) and thrift.json's decode_wgs section (per compute warpgroups, JSON's string keys)."""
    from benchmarks.render_results import render_decode_wgs, render_dq_schedule

    row = dict(method="sage", shape=[4, 32, 4096, 128, False], ms={"default": 6.0, "under_dk": 5.0, "cudnn_bf16": 6.6},
               speed_vs_default={"default": 1.0, "under_dk": 1.2, "cudnn_bf16": 6.0 / 6.6},
               grads_vs_default={"under_dk": [1e-7, 2e-7, 3e-7]})
    page = "\n".join(render_dq_schedule(dict(env=_env("2026-12-01 00:00:00"), command="dq_schedule.py", rows=[row])))
    assert "| sage | 4, 32, 4096, 128, False | 6.600 (0.91×) | 6.000 (1.000×) | 5.000 (1.200×) | under_dk 3.0e-07 |" \
        in page
    wgs = dict(b=8, hq=32, hkv=8, s=8192, d=128, t=1, max_abs_vs_1={"1": 0.0, "2": 0.0},
               ms={"cudnn_bf16": 0.1, "op wgs1": 0.08, "kernels wgs1": 0.06, "op wgs2": 0.05},
               vs_cudnn_bf16={"cudnn_bf16": 1.0, "op wgs1": 1.25, "kernels wgs1": 0.1 / 0.06, "op wgs2": 2.0})
    table = "\n".join(render_decode_wgs([wgs]))
    assert ("| B8 H32/8 S8192 D128 T1 | 0.1000 (1.00×) | 0.0800 (1.25×) | 0.0600 (1.67×) | 0.0500 (2.00×) | – "
            "| 2: 0.0e+00 |") in table
