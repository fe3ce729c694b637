"""benchmarks/profiling.py (interval union, grouping, a trace: on the CPU no GPU plane, no kernels) and
benchmarks/variants.py (switch parsing, the spill report), benchmarks/data_parallel.py (a smoke run),
benchmarks/smem_report.py (lowered on the CPU), benchmarks/sass_census.py (a synthetic listing),
benchmarks/probes/ncu_sass.py (a synthetic Nsight Compute page), benchmarks/probes/transfer_plans.py and
benchmarks/probes/barrier_census.py (lowered on the CPU)."""

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks.profiling import _union_ns, grouped, kinds_in_group, profile_calls


def test_union_counts_overlaps_once():
    assert _union_ns([]) == 0
    assert _union_ns([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert _union_ns([(20, 30), (0, 10), (10, 12)]) == 22  # unsorted, touching


def test_grouped_first_matching_group_wins():
    kernels = {"sage_bwd_dkdv": (2.0, 1), "nvjet_sm90_gemm": (1.5, 3), "loop_add_fusion": (0.5, 2)}
    groups = {"attention": ("sage",), "matmul": ("gemm", "nvjet")}
    assert grouped(kernels, groups) == {"attention": 2.0, "matmul": 1.5, "other": 0.5}


def test_other_kernels_compare_by_kind():
    """XLA numbers its fusions per program, so breakdown.py compares the "other" kernels of two methods by kind
    (the name less a trailing number); kernels of the named groups are left out."""
    from benchmarks.breakdown import other_kinds_table

    groups = {"attention": ("sage", "cudnn"), "matmul": ("nvjet",)}
    dense = {"cudnn_sdpa": (5.0, 1), "loop_convert_fusion_10": (2.0, 11), "loop_convert_fusion_33": (0.5, 23),
             "nvjet_sm90": (3.0, 34), "fusion_4183": (0.4, 11)}
    sage = {"sage_bwd_dkdv": (6.0, 1), "loop_convert_fusion_10": (2.0, 11), "loop_convert_fusion_44": (0.875, 11),
            "fusion_4271": (0.4, 11), "input_reduce_fusion_3": (0.25, 11), "fusion": (0.1, 1)}
    assert kinds_in_group(dense, groups) == [("loop_convert_fusion", 2.5, 34), ("fusion", 0.4, 11)]
    assert kinds_in_group(sage, groups) == [("loop_convert_fusion", 2.875, 22), ("fusion", 0.5, 12),
                                            ("input_reduce_fusion", 0.25, 11)]
    assert kinds_in_group(sage, groups, "attention") == [("sage_bwd_dkdv", 6.0, 1)]
    table = other_kinds_table({"dense": kinds_in_group(dense, groups), "sage": kinds_in_group(sage, groups)})
    lines = table.strip().splitlines()
    assert lines[0].endswith("dense | sage") and len(lines) == 4
    # the kinds whose times differ most come first: 0.375 (convert), 0.25 (reduce), 0.1 (fusion)
    assert [line.split()[-1] for line in lines[1:]] == ["loop_convert_fusion", "input_reduce_fusion", "fusion"]
    assert lines[2].split()[:3] == ["0.000", "|", "0.250"]


def test_results_parts_rerun_alone_or_carried(monkeypatch, tmp_path):
    """``common.rerun_part`` replaces one part of a results file and records its own command and date, dropping the
    older run's note about that part; ``common.carried_part`` keeps a part for a run that skips it, with the command
    and date it came from (its own, else the file's) and its note."""
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    assert common.carried_part("r", "checks") == {"checks": [], "checks_command": None, "checks_date": None}
    env = {"date": "d1"}
    common.write_json("r", dict(env={"date": "d0"}, command="full", checks=[1], rows=[7]))
    assert common.carried_part("r", "checks") == {"checks": [1], "checks_command": "full", "checks_date": "d0"}
    payload = common.rerun_part("r", "checks", [2], command="alone", env=env)
    assert payload == dict(env={"date": "d0"}, command="full", checks=[2], rows=[7], checks_command="alone",
                           checks_date="d1")
    common.write_json("r", dict(payload, checks_note="carried", checks_from="old"))
    assert common.carried_part("r", "checks") == {"checks": [2], "checks_command": "alone", "checks_date": "d1",
                                                   "checks_note": "carried"}
    again = common.rerun_part("r", "checks", [3], command="alone", env={"date": "d2"})
    assert "checks_note" not in again and "checks_from" not in again and again["checks_date"] == "d2"
    assert common.rerun_part("new", "memory", [4], command="m", env=env) == dict(
        env=env, memory=[4], memory_command="m", memory_date="d1")


def test_profile_calls_traces_a_jitted_function():
    f = jax.jit(lambda x: jnp.sin(x @ x).sum())
    x = jax.random.normal(jax.random.key(0), (64, 64))
    f(x).block_until_ready()
    prof = profile_calls(lambda: f(x).block_until_ready(), calls=2)
    assert prof["wall_ms"] > 0 and prof["calls"] == 2
    if jax.default_backend() == "cpu":  # host-only trace: no GPU stream events
        assert prof["kernels"] == {} and prof["busy_ms"] == 0
    else:
        assert prof["busy_ms"] > 0 and prof["kernel_ms"] >= prof["busy_ms"] * 0.99


def test_variant_switches_parse_and_misspellings_fail():
    """benchmarks/variants.py: `module.ATTR=literal` lists, shapes, and a switch the module lacks."""
    from benchmarks import variants

    assert variants.parse_assignments("a.b.C=True, a.D='x',") == [("a.b", "C", True), ("a", "D", "x")]
    assert variants.parse_variant("base=") == ("base", [])
    assert variants.parse_shape("16,10,5,2048,64,1") == (16, 10, 5, 2048, 64, True)
    for bad in ("C=1", "a.C", "a.C=not a literal"):
        with pytest.raises(ValueError):
            variants.parse_assignments(bad)
    with pytest.raises(ValueError):
        variants.parse_shape("1,2,3")
    variants.apply([("pallas_kernels._mosaic", "SKIP_VISIBLE_TILES", False)], only_check=True)
    from pallas_kernels import _mosaic
    assert _mosaic.SKIP_VISIBLE_TILES is True  # only looked up
    with pytest.raises(AttributeError, match="SKIP_VISIBLE_TILE"):
        variants.apply([("pallas_kernels._mosaic", "SKIP_VISIBLE_TILE", False)], only_check=True)
    # config.FIELD: checked against the method's config and returned, not set anywhere
    assert variants.apply(variants.parse_assignments("config.fwd_backend='mosaic'")) == {"fwd_backend": "mosaic"}
    assert variants.apply([("config", "pingpong", False)], method="qat") == {"pingpong": False}
    with pytest.raises(AttributeError, match="fwd_backnd"):
        variants.apply([("config", "fwd_backnd", "mosaic")], only_check=True)
    with pytest.raises(AttributeError, match="pingpong"):  # a QatConfig field is not a SageFwdConfig one
        variants.apply([("config", "pingpong", False)], method="sage")


def test_variant_child_profiles_each_shape(monkeypatch):
    """``variants.py --profile``: the child traces each shape's calls and keeps the busy time and the top kernels
    (``benchmarks.profiling``; the trace's GPU planes, none on the CPU, are stubbed here)."""
    import argparse

    from benchmarks import profiling, variants

    seen = []
    fake = dict(kernels={f"k{i}": (0.5 - 0.01 * i, 1.0) for i in range(12)}, busy_ms=1.25)
    monkeypatch.setattr(profiling, "profile_calls", lambda run, calls: seen.append(run()) or fake)
    args = argparse.Namespace(assign="", method="sage", shapes="[[1, 2, 2, 64, 64, 0]]", part="fwd", check=False,
                              profile=True)
    result = variants.child(args)
    assert len(seen) == 1 and result["busy_ms"] == {"1,2,2,64,64,0": 1.25}
    assert list(result["kernels"]["1,2,2,64,64,0"]) == [f"k{i}" for i in range(variants.PROFILE_TOP)]
    assert "kernels" not in variants.child(argparse.Namespace(**{**vars(args), "profile": False}))


def test_variant_check_compares_the_row_outputs(monkeypatch):
    """``variants.py --check`` also compares the forward's row outputs with the xla reference's (the LSE; QAT's m
    and O′): the backward alone reads them, and a forward whose LSE stores went to the wrong head passed a check
    of o (benchmarks/NOTES.md, thirty-fifth session). An LSE with its heads swapped must show."""
    import jax
    import jax.numpy as jnp

    import lowbit_jax as lb
    from benchmarks import variants

    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (1, 96, 4, 64), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, 80, 2, 64), jnp.bfloat16) for key in keys[1:])
    configs = {"sage": lb.sage_fwd_config(64, True), "qat": lb.qat_config(64, True)}
    for method, names in (("sage", {"lse"}), ("qat", {"lse", "m", "o_aux"})):
        got = variants.row_outputs_check(method, q, k, v, causal=True, config=configs[method], interpret=True)
        assert set(got) == names and max(got.values()) < 1e-4, (method, got)
    sage_forward = lb.sage_forward

    def swapped_heads(*args, implementation, **kw):
        o, lse, ops = sage_forward(*args, implementation=implementation, **kw)
        return o, (jnp.flip(lse, axis=1) if implementation == "pallas" else lse), ops

    monkeypatch.setattr(lb, "sage_forward", swapped_heads)
    got = variants.row_outputs_check("sage", q, k, v, causal=True, config=configs["sage"], interpret=True)
    assert got["lse"] > 1e-2, got


def test_variant_that_fails_or_hangs_is_skipped_with_child_timeout(monkeypatch, tmp_path):
    """``variants.py --child-timeout``: a variant whose child fails or runs past the limit (a kernel that deadlocks)
    is reported and skipped and the others still run; without the option a failure stops the run."""
    import subprocess

    from benchmarks import common, variants

    def fake_run(cmd, timeout=None, **kw):
        assign = cmd[cmd.index("--assign") + 1]
        if "HANG" in assign:
            assert timeout == 5.0
            raise subprocess.TimeoutExpired(cmd, timeout)
        if "FAIL" in assign:
            return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="boom")
        return subprocess.CompletedProcess(cmd, 0, stdout='RESULT {"ms": {"s": 1.0}}\n', stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(variants, "apply", lambda *a, **kw: {})
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")  # not the repository's variants.json
    argv = ["--variant", "hang=m.HANG=1", "--variant", "fail=m.FAIL=1", "--variant", "ok=", "--shape",
            "1,2,2,64,64,0", "--repeats", "1", "--child-timeout", "5"]
    assert variants.main(argv) == 0
    runs = json.loads((tmp_path / "variants.json").read_text())["runs"]
    assert [r["variant"] for r in runs] == ["hang", "fail", "ok"]
    assert "ran past 5.0 s" in runs[0]["error"] and "boom" in runs[1]["error"] and runs[2]["ms"] == {"s": 1.0}
    with pytest.raises(RuntimeError, match="boom"):
        variants.main(argv[2:-2])


def test_variant_spill_report_takes_each_kernels_largest():
    """Per kernel name, the largest spill (and stack frame) of ptxas -v's entry lines. ptxas warns of a
    kernel's spills *before* its "Compiling entry function" line (as on the H200 in the eighteenth
    session): that warning must not count for the kernel compiled before it."""
    from benchmarks import variants

    log = ("ptxas info    : Compiling entry function 'k_one' for 'sm_90a'\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas warning : Registers are spilled to local memory in function 'k_two', 208 bytes spill stores, "
           "208 bytes spill loads\n"
           "ptxas info    : Compiling entry function 'k_two' for 'sm_90a'\n"
           "    96 bytes stack frame, 208 bytes spill stores, 208 bytes spill loads\n"
           "ptxas info    : Compiling entry function 'k_one' for 'sm_90a'\n"
           "    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n")
    assert variants.spills(log) == {"k_one": 8, "k_two": 208}
    assert variants.spills(log, stack_frame=True) == {"k_one": 8, "k_two": 96}


def test_data_parallel_smoke_agrees_with_one_device():
    """benchmarks/data_parallel.py --smoke on the CPU's forced devices: bf16 steps on 1 and on 4 devices
    from the same start give the same losses up to rounding, and every part of the JSON is filled."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py forces 8 host devices on CPU)")
    from benchmarks import data_parallel
    from benchmarks.common import RESULTS_DIR

    assert data_parallel.main(["--smoke", "--devices", "4", "--methods", "sage", "--check-steps", "2"]) == 0
    out = json.loads((RESULTS_DIR / "data_parallel_smoke.json").read_text())
    (row,) = out["agreement"]
    assert out["devices"] == 4 and row["method"] == "sage" and len(row["loss_many"]) == 2
    assert row["loss_rel_diff"] < 2e-3 and row["grad_norm_rel_diff"] < 1e-2  # bf16 rounding, not a wrong mean
    assert row["loss_rel_diff_noise"] == 0.0  # the CPU is deterministic
    (tp,) = out["throughput"]
    assert tp["tokens_per_s_many"] > 0 and tp["efficiency"] > 0 and len(tp["step_ms_rounds_many"]) == 2


def test_dq_kernel_carries_the_other_head_dims_rows(tmp_path):
    """benchmarks/dq_kernel.py --head-dim: rows and checks of the other head dim are kept from the file,
    marked with the date of their run (an already carried row keeps its first date), in SHAPES order."""
    from benchmarks import dq_kernel

    d64, d128 = ([8, 32, 32, 2048, 64, False], [4, 32, 32, 4096, 128, False])
    old = dict(env=dict(date="2026-11-30 11:38:05"),
               checks=[dict(case=[2, 380, 512, 4, 2, 64, False]), dict(case=[2, 380, 512, 4, 2, 128, False])],
               rows=[dict(shape=d128), dict(shape=d64, carried_from="2026-11-29 10:00:00")])
    path = tmp_path / "dq_kernel.json"
    path.write_text(json.dumps(old))
    kept = dq_kernel.carry_rows(path, lambda d: d != 128)
    assert [c["case"][5] for c in kept["checks"]] == [64]
    assert kept["checks"][0]["carried_from"] == "2026-11-30 11:38:05"
    assert kept["rows"] == [dict(shape=d64, carried_from="2026-11-29 10:00:00")]
    assert dq_kernel.carry_rows(tmp_path / "missing.json", lambda d: True) == dict(checks=[], rows=[])
    assert [r["shape"] for r in dq_kernel.sort_rows([dict(shape=d128), dict(shape=d64)])] == [d64, d128]


def test_nvfp4_scale_check_runs_and_counts_the_old_division():
    """benchmarks/nvfp4_scale_check.py on the first 2**24 bit patterns (XLA off the GPU): no mismatch for
    group_scale, and the counting works (``amax / 6`` as XLA compiles it is wrong at 0.11132812·2**k, which
    lie beyond this chunk, so 0 here too; the full run counts 15)."""
    from benchmarks import nvfp4_scale_check as check

    fns = check.backends(["xla"])
    assert check.scale_mismatches(fns, 1, old=True) == {"xla": 0, "xla_divide": 0}
    assert check.reciprocal_mismatches(fns) == {"xla": 0}
    bad = {"xla": (lambda x: jnp.zeros_like(x), lambda s: s)}  # a wrong scale and a wrong reciprocal
    assert check.scale_mismatches(bad, 1, old=False)["xla"] > 0 and check.reciprocal_mismatches(bad)["xla"] > 0


def test_qat_table_keeps_only_the_methods_a_run_timed():
    """render_results: Attn-QAT's throughput table (``qat.py --methods`` times a subset) has a column for
    each method some row timed, and a ratio column only where cuDNN's time is there too; the fwd+bwd ratios (the
    issue's target) with three decimals."""
    from benchmarks.render_results import _qat_throughput_table

    def row(fwd, fwd_bwd):
        ratio = lambda t: {m: v / t["cudnn_bf16"] for m, v in t.items()} if "cudnn_bf16" in t else {}  # noqa: E731
        return dict(b=4, h=32, s=4096, d=128, causal=True, fwd_tflops=fwd, fwd_bwd_tflops=fwd_bwd,
                    fwd_vs_cudnn_bf16=ratio(fwd), fwd_bwd_vs_cudnn_bf16=ratio(fwd_bwd))

    pp = "qat_mosaic_pingpong"
    some = _qat_throughput_table([row({pp: 300.0, "cudnn_bf16": 600.0}, {pp: 330.0, "cudnn_bf16": 500.0})])
    assert some[0] == ("| B | H | S | D | causal | fwd: mosaic+pp | cuDNN bf16 | mosaic+pp / cuDNN | "
                       "fwd+bwd: mosaic+pp | cuDNN bf16 | **mosaic+pp / cuDNN** |")
    assert some[1].count("|---") == 11 and some[2].endswith("| 300 | 600 | 0.50× | 330 | 500 | **0.660×** |")
    full = {m: 100.0 for m in ("qat", "qat_mosaic", pp, "sage", "cudnn_bf16")}
    table = _qat_throughput_table([row(full, {**full, "qat_naive_bwd": 100.0})])
    assert table[0].count("|") - 1 == 5 + 5 + 2 + 6 + 3
    assert "qat naive" in table[0] and "**qat / cuDNN**" in table[0]
    no_cudnn = _qat_throughput_table([row({pp: 1.0}, {pp: 1.0})])
    assert "/ cuDNN" not in no_cudnn[0]


def test_smem_report_measures_each_kernel_and_the_padding_switch(monkeypatch):
    """benchmarks/smem_report.py reads each Mosaic GPU kernel's SMEM off its lowering for an H200 (CPU only);
    ``_mosaic.EXTRA_SMEM_BYTES`` pads every kernel by exactly that many bytes, and the carveout steps follow."""
    from benchmarks import smem_report
    from pallas_kernels import _mosaic

    base = dict(smem_report.lowered_kernels("sage", 64, True, "fused", seq=256))
    assert set(base) == {"sage_attention_fwd", "sage_bwd_dkdv_dq"}, base
    assert 32 * 1024 < base["sage_attention_fwd"] < base["sage_bwd_dkdv_dq"] < 227 * 1024
    monkeypatch.setattr(_mosaic, "EXTRA_SMEM_BYTES", 8192)
    jax.clear_caches()  # the kernels' jitted wrappers would otherwise keep the unpadded trace
    padded = dict(smem_report.lowered_kernels("sage", 64, True, "fused", seq=256))
    assert {k: padded[k] - base[k] for k in base} == {k: 8192 for k in base}
    jax.clear_caches()
    assert [smem_report.carveout_kib(k * 1024) for k in (0, 99, 100, 163, 164, 227, 228)] == [
        8, 100, 132, 164, 196, 228, None]


def test_sass_census_finds_the_hot_loop_not_the_retry_stubs():
    """benchmarks/sass_census.py on a `cuobjdump -sass` shaped listing: the loop with tensor-core instructions
    is found among the loops before the last EXIT; the barrier-wait stubs after it (which branch back into the
    loop) are not loops; predicates are stripped from opcodes."""
    from benchmarks import sass_census

    body = [(0x00, "S2R R0, SR_TID.X"),
            (0x10, "SYNCS.ARRIVE.TRANS64 RZ, [UR4], RZ"), (0x20, "UTMALDG.3D [UR8], [UR6]"), (0x30, "@P0 BRA 0x10"),
            (0x40, "WARPGROUP.ARRIVE"), (0x50, "IGMMA.64x64x32.S8.S8 R24, gdesc[UR20], RZ, !UPT"),
            (0x60, "@!P2 BRA 0x200"), (0x70, "FMNMX.NAN R3, R4, R5, !PT"), (0x80, "FMNMX.NAN R3, R3, R6, !PT"),
            (0x90, "@!UP1 BRA 0x40"), (0xa0, "EXIT"),
            (0x200, "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR11], R24"), (0x210, "@!P2 BRA 0x200"),
            (0x220, "BRA 0x70")]
    listing = "\n\tcode for sm_90a\n" + "\n".join(
        f"        /*{a:04x}*/                   {t} ;   /* 0x000000000000000 */\n"
        "                                                   /* 0x000fe20000000000 */" for a, t in body)
    instrs = sass_census.parse(listing)
    assert [a for a, _ in instrs] == [a for a, _ in body]
    assert sass_census.opcode("@!UP1 BRA 0x40") == "BRA" and sass_census.opcode("@PT FMUL R1, R2, R3") == "FMUL"
    assert sass_census.loops(instrs) == [(0x10, 0x30), (0x40, 0x90)]
    assert sass_census.hot_loop(instrs) == (0x40, 0x90)
    report = sass_census.report("k", listing)
    assert report["loop_instructions"] == 6
    assert report["census"] == {"FMNMX.NAN": 2, "BRA": 2, "WARPGROUP.ARRIVE": 1, "IGMMA.64x64x32.S8.S8": 1}
    assert sass_census.report("none", "\n".join(listing.splitlines()[:8]))["loop"] is None


def test_training_ratios_pair_each_method_with_the_dense_run_of_its_remat():
    from benchmarks.training import baseline, ratios_to_dense

    assert baseline("sage") == "dense" and baseline("sage:row@block") == "dense@block"
    times = {"dense": [2.0, 4.0], "sage": [4.0, 4.0], "dense@block": [3.0, 3.0], "sage@block": [6.0, 3.0],
             "qat_fp4@dots": [1.0, 1.0]}
    got = ratios_to_dense(times)
    assert got == {"dense": [1.0, 1.0], "sage": [0.5, 1.0], "dense@block": [1.0, 1.0], "sage@block": [0.5, 1.0]}


def test_thrift_decode_bytes_and_results_table():
    """benchmarks/thrift.py counts 2 bytes per value for a 16-bit block and 0.5625 for a 4-bit one, and
    render_results renders the committed thrift.json (its gap-recovered column from the run's own errors)."""
    import numpy as np

    import lowbit_jax as lb
    from benchmarks import thrift
    from benchmarks.render_results import _load, render_thrift

    cache = lb.ThriftKVCache.create(1, 256, 2, 64, block=64)
    sel = np.zeros((1, 2, 4), bool)
    sel[0, 0, 1] = True
    got = thrift.decode_bytes(cache, sel)
    assert got["bf16"] == 2 * 2 * 256 * 64 * 2
    assert got["thrift"] == 2 * 64 * 64 * 2 + 7 * 2 * 64 * 64 * 0.5625  # K and V: one 16-bit block, seven 4-bit
    data = _load("thrift")
    text = "\n".join(render_thrift(data))
    heavy = [r for r in data["accuracy"] if r["inputs"] == "heavy" and r["budget"] == 0.05][0]
    assert f"{heavy['gap_recovered']:.1%}" in text and "ThriftAttention" in text


def test_thrift_partial_run_keeps_the_other_sections(tmp_path):
    """``benchmarks/thrift.py --sections decode`` keeps the results file's other sections with the provenance of
    the run that measured them, and RESULTS.md names that run."""
    import json

    from benchmarks import thrift
    from benchmarks.render_results import render_thrift

    old_env = dict(device="H200", jax="0.11.2", date="2026-01-01 00:00:00")
    path = tmp_path / "thrift.json"
    path.write_text(json.dumps(dict(env=old_env, command="old", checks=[], decode=["stale"], sweep=[])))
    new_env = dict(old_env, date="2026-02-02 00:00:00")
    got = thrift.keep_other_sections(dict(env=new_env, command="new --sections decode"), path, ["decode"])
    assert "decode" not in got and got["checks"] == [] and got["sweep"] == []  # decode comes from the new run
    assert got["provenance"]["decode"]["command"] == "new --sections decode"
    assert got["provenance"]["sweep"] == dict(env=old_env, command="old")
    again = thrift.keep_other_sections(dict(env=new_env, command="newer", decode=[]), path.with_name("none.json"),
                                       ["decode"])
    assert set(again["provenance"]) == {"decode"}  # no previous file: only what ran
    text = "\n".join(render_thrift(dict(got, decode=[])))
    assert "Sections checks, sweep from another run (2026-01-01 00:00:00): `old`" in text


def test_thrift_quality_gap_and_paired_error_and_table():
    """benchmarks/thrift_quality.py: Δ vs dense is the mean of the per-window differences with their standard error,
    the gap recovered is (L(0) − L(f)) / (L(0) − L(1)); render_results renders the committed run."""
    import numpy as np

    from benchmarks.render_results import _load, render_thrift_quality
    from benchmarks.thrift_quality import compare, gap_recovered

    def res(windows, budget, buckets):
        loss = float(np.mean(windows))
        return dict(window_loss=windows, loss=loss, bits_per_byte=loss / np.log(2), bucket_loss=buckets,
                    budget=budget, seconds=1.0)

    results = {"dense": res([1.0, 2.0, 3.0], None, [2.0, 2.0]),
               "thrift f=1": res([1.0, 2.0, 3.1], 1.0, [2.0, 2.1]),
               "thrift f=0.5": res([1.5, 2.0, 3.4], 0.5, [2.2, 2.4]),
               "thrift f=0": res([2.0, 3.0, 3.6], 0.0, [2.5, 3.0])}
    rows = {r["variant"]: r for r in compare(results)}
    np.testing.assert_allclose(rows["thrift f=0.5"]["delta"], 0.3)
    np.testing.assert_allclose(rows["thrift f=0.5"]["delta_stderr"], np.std([0.5, 0.0, 0.4], ddof=1) / np.sqrt(3))
    l0, l1, lf = np.mean([2.0, 3.0, 3.6]), np.mean([1.0, 2.0, 3.1]), np.mean([1.5, 2.0, 3.4])
    np.testing.assert_allclose(rows["thrift f=0.5"]["gap_recovered"], (l0 - lf) / (l0 - l1))
    assert rows["thrift f=0"]["gap_recovered"] == 0.0 and rows["thrift f=1"]["gap_recovered"] == 1.0
    assert "gap_recovered" not in rows["dense"] and gap_recovered(1.0, 2.0, 2.0) is None
    data = _load("thrift_quality")
    text = "\n".join(render_thrift_quality(data))
    f05 = [r for r in data["rows"] if r["variant"] == "thrift f=0.05"][0]
    assert f"| thrift f=0.05 | {f05['loss']:.4f} |" in text and f"{f05['gap_recovered']:.1%}" in text


def test_serving_caches_hold_the_same_tokens_and_the_table_renders():
    """benchmarks/serving.py fills every method's caches with the same K/V (the dense dict and the ThriftKVCache),
    its decode step donates them and advances them by one token, and render_results renders a run."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks import serving
    from benchmarks.render_results import render_serving
    from models import TransformerLM, model_config

    dense = TransformerLM(model_config("tiny", method="dense", max_len=96), rngs=nnx.Rngs(0))
    thrift = serving.with_method(dense, "thrift", dict(budget=1.0, implementation="xla"))
    a, b = serving.filled_caches(dense, 2, 70), serving.filled_caches(thrift, 2, 70)
    assert len(a) == len(b) == dense.cfg.num_layers
    for ca, cb in zip(a, b):
        assert int(ca["length"]) == int(cb.length) == 70
        np.testing.assert_array_equal(np.asarray(ca["k"][:, :70], np.float32), np.asarray(cb.k[:, :70], np.float32))
        assert not np.asarray(ca["v"][:, 70:], np.float32).any()
    tok, new = serving.decode_step(thrift)(nnx.state(dense), jnp.ones((2, 1), jnp.int32), b)
    assert tok.shape == (2, 1) and int(new[0].length) == 71
    ms = {"dense": 2.0, "thrift f=0.05": 1.0}
    row = dict(preset="tiny", params=1e6, layers=4, heads=4, kv_heads=2, head_dim=64, batch=2, length=70, steps=2,
               rounds=1, ms=ms, tokens_per_s={n: 2e3 / t for n, t in ms.items()},
               vs_dense={n: 2.0 / t for n, t in ms.items()})
    text = "\n".join(render_serving(dict(env=dict(device="cpu", jax="0.11.2", date="now"), command="x", rows=[row])))
    assert "| 2 | 70 | thrift f=0.05 | 1.000 | 2,000 | 2.00× |" in text


def test_serving_prefill_runs_and_its_table_renders(monkeypatch):
    """benchmarks/serving.py --prefill's op row (XLA only on the CPU; a float32 error that is small but not zero)
    and model row (a tiny preset: the decode of a prompt gives the forward's logits by every route), rendered."""
    from benchmarks import serving
    from benchmarks.render_results import render_serving_prefill

    op = serving.prefill_op(1, 40, 24, 96, 4, 2, 32, impls=("xla",), log=lambda *_: None)
    assert 0 < op["rel_l2"]["xla"] < 2e-2 and op["ms"]["xla"] > 0 and op["temp_mib"]["xla"] >= 0
    row = serving.prefill_model("tiny", 1, 40, 96, impl=dict(implementation="xla"), log=lambda *_: None)
    assert set(row["ms"]) == {f"{m} {r}" for m in ("dense", "thrift f=0.05") for r in (
        "forward (no cache)", "prefill", "decode", "decode, route before")}
    diffs = row["logits_max_abs_vs_forward"]
    routes = ("prefill", "decode", "decode, route before")
    assert all(diffs[f"dense {r}"] < 0.05 * row["logits_max_abs"] for r in routes), diffs
    # the thrift prefill is the forward pass, by either entry; its decode calls are not
    assert diffs["thrift f=0.05 prefill"] == diffs["thrift f=0.05 decode"] == 0, diffs
    assert diffs["thrift f=0.05 decode, route before"] > 1e-3, diffs
    assert all(t > 0 for t in row["first_call_s"].values())
    text = "\n".join(render_serving_prefill(dict(env=dict(device="cpu", jax="0.11.2", date="now"), command="x",
                                                ops=[dict(op, ms=dict(op["ms"], cudnn=op["ms"]["xla"] / 2),
                                                          temp_mib=dict(op["temp_mib"], cudnn=0.0),
                                                          rel_l2=dict(op["rel_l2"], cudnn=1e-3),
                                                          max_abs_between=1e-3)], models=[row])))
    assert "| 1 | 40 | 24 | 96 | 4/2 | 32 |" in text and "| 2.0× |" in text and "| thrift f=0.05 prefill |" in text


def test_ncu_sass_summary_splits_kernels_and_ranks_stalls(tmp_path):
    """benchmarks/probes/ncu_sass.py on a synthetic `ncu --page source --csv --print-source sass` file: two kernels,
    each with its own header; samples are shared out by reason and opcode, ``--rows`` keeps a part."""
    from benchmarks.probes.ncu_sass import load, summary

    head = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
            '"stall_barrier","stall_long_sb","stall_long_sb (Not Issued)"')
    text = "\n".join([
        '"Kernel Name","k_one",', head,
        '"0x10","      @!P1  BRA 0x20","30","5","0","30","1"',
        '"0x20","      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ","10","4","0","0","0"',
        '"0x30","      WARPGROUP.DEPBAR.LE gsb0, 0x0","60","4","60","0","0"',
        '"Kernel Name","k_two",', head,
        '"0x10","      FADD R1, R2, R3","7","9","0","7","0"',
    ])
    path = tmp_path / "x.sass.csv"
    path.write_text(text + "\n")
    kernels = load(str(path))
    assert [name for name, _ in kernels] == ["k_one", "k_two"] and [len(rows) for _, rows in kernels] == [3, 1]
    out = summary("k_one", kernels[0][1], 0, 3, top=2)
    assert "barrier 60.0%, long_sb 30.0%" in out and "WARPGROUP 60.0%, BRA 30.0%" in out
    assert "DEPBAR" in out and "HGMMA" not in out.split("top 2")[1]  # the two most sampled rows only
    part = summary("k_one", kernels[0][1], 1, 3, top=5)
    assert "70.0% of 100 samples" in part and "barrier 85.7%" in part


@pytest.mark.parametrize("permuted,swizzle", [(False, 128), (False, 32), (True, 128)])
def test_transfer_plans_find_the_staggered_dq_stage(monkeypatch, permuted, swizzle):
    """benchmarks/probes/transfer_plans.py lowers the fused SageBwd backward (D64 causal) on the CPU and lists Mosaic
    GPU's register ↔ SMEM transfer plans. With the 128-byte float32 dQ stage stored by Mosaic GPU in natural column
    order its stores are the only staggered transfers (forty-third session); with a 32-byte stage
    (``dq_stage.STAGE_SWIZZLE``) none are; with the permuted order (``dq_stage``, committed) the stage is stored by
    inline 16-byte stores, so Mosaic GPU plans no float32 transfer and none is staggered."""
    from benchmarks.probes.transfer_plans import transfer_plans
    from pallas_kernels import dq_stage

    monkeypatch.setattr(dq_stage, "STAGE_SWIZZLE", swizzle)
    monkeypatch.setattr(dq_stage, "ENABLED", permuted)
    plans = transfer_plans("sage", 64, True, seq=256)
    staggered = {key for key in plans if key[3] == "StaggeredTransferPlan"}
    float32_tiles = {key for key in plans if key[1] == 32 and key[2] == swizzle and len(key[0]) == 2}
    assert plans  # the kernels' other transfers were seen
    if permuted:
        assert not staggered and not float32_tiles, plans
        return
    assert float32_tiles, plans  # the stage's stores were seen
    assert staggered == (float32_tiles if swizzle == 128 else set()), plans


@pytest.mark.parametrize("method", ["qat", "sage"])
def test_barrier_census_sees_the_backwards_own_barriers(monkeypatch, method):
    """benchmarks/probes/barrier_census.py lowers a fwd+bwd (D64 non-causal) on the CPU and counts each Mosaic GPU
    kernel's barriers from the module its custom call carries: the dK/dV/dQ kernel with its own barriers
    (``qat_bwd_mosaic.manual_barriers``, ``sage_bwd_mosaic.manual_barriers``) has fewer ``bar.sync`` than with
    Pallas's automatic ones, and still its fences and tensor-core waits; the forward, which the switch does not
    touch, the same counts both times."""
    from benchmarks.probes.barrier_census import barrier_census
    from pallas_kernels import qat_bwd_mosaic, sage_bwd_mosaic

    module = {"qat": qat_bwd_mosaic, "sage": sage_bwd_mosaic}[method]
    fwd, bwd = f"{method}_attention_fwd", f"{method}_bwd_dkdv_dq"
    counts = {}
    for manual in (True, False):
        monkeypatch.setattr(module, "MANUAL_BARRIERS", manual)
        counts[manual] = barrier_census(method, 64, False, seq=256)
    assert set(counts[True]) == set(counts[False]) == {fwd, bwd}, counts
    own, auto = counts[True][bwd], counts[False][bwd]
    assert 0 < own.bar_sync < auto.bar_sync, counts
    assert own.fence_proxy == auto.fence_proxy > 0 and own.wgmma_wait == auto.wgmma_wait > 0, counts
    assert counts[True][fwd] == counts[False][fwd], counts


def test_time_rounds_interleaves_methods_and_keeps_the_median():
    """benchmarks.common.time_rounds: every entry is timed once per round, entries in turn (a, b, a, b, …, not a, a,
    b, b), each round's time kept and the median returned; compiled_entries runs each method's entries once, keeps
    those that ran and records a failing method's first error instead of raising; render_results notes
    interleaved rounds only where a row has them."""
    from benchmarks import render_results
    from benchmarks.common import compiled_entries, time_rounds

    order, logged = [], []

    def entry(name):
        def fn(x):
            order.append(name)
            return x + 1.0
        return fn, (jnp.ones(4),)

    def broken(x):
        raise ValueError("no kernel for this shape")

    errors = {}
    timed = compiled_entries({"m1": {"a": entry("a"), "b": entry("b")},
                              "m2": {"c": entry("c"), "d": (broken, (jnp.ones(4),))}}, errors, logged.append, " at X")
    assert set(timed) == {"a", "b"} and order == ["a", "b", "c"]
    assert errors == {"m2": "ValueError: no kernel for this shape"} and logged == [f"  m2 failed at X: {errors['m2']}"]
    order.clear()
    ms, per_round = time_rounds(timed, 3, warmup=1, iters=2, batches=1)
    assert order == (["a"] * 3 + ["b"] * 3) * 3  # per round: a's warm-up and batch, then b's
    assert set(ms) == {"a", "b"} and all(len(ts) == 3 for ts in per_round.values())
    assert all(ms[n] == sorted(per_round[n])[1] > 0 for n in ms)
    assert render_results._rounds_note([{"b": 1}, {"rounds": 1}]) == []
    assert "3 interleaved rounds" in render_results._rounds_note([{"rounds": 3}])[0]
    assert "untimed" not in render_results._rounds_note([{"rounds": 3}])[0]
    assert "after 5 untimed calls" in render_results._rounds_note([{"rounds": 3, "warmup": 5}])[0]


def test_qat_table_takes_rows_rounds_and_carries_its_checks(monkeypatch, tmp_path):
    """``benchmarks/qat.py`` for repeated verdict runs: ``--shapes`` picks rows, ``--rounds``/``--warmup`` reach the
    interleaved timing, ``--skip-checks`` keeps the results file's kernel checks and accuracy (with their command)
    instead of re-running them, ``--name`` picks the file; a malformed row is refused."""
    from benchmarks import common, qat

    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    common.write_json("rows", dict(env={"date": "d0"}, command="full", kernel_checks=[1], accuracy=[2]))
    seen = {}

    def fake_throughput(shapes, config, log, save, smoke, methods=None, rounds=0, warmup=0):
        seen.update(shapes=shapes, methods=methods, rounds=rounds, warmup=warmup)
        save([{"timed": True}])
        return []

    monkeypatch.setattr(qat, "throughput", fake_throughput)
    monkeypatch.setattr(qat, "check_kernels", lambda *a: pytest.fail("--skip-checks re-ran the kernel checks"))
    monkeypatch.setattr(qat, "accuracy", lambda *a: pytest.fail("--skip-checks re-ran the accuracy"))
    argv = ["--smoke", "--skip-checks", "--name", "rows", "--shapes", "8,32,2048,64,0", "4,32,4096,128,1",
            "--rounds", "7", "--warmup", "3", "--methods", "cudnn_bf16"]
    assert qat.main(argv) == 0
    assert seen == dict(shapes=[(8, 32, 2048, 64, False), (4, 32, 4096, 128, True)], methods=["cudnn_bf16"],
                        rounds=7, warmup=3)
    out = json.loads((tmp_path / "rows.json").read_text())
    assert out["kernel_checks"] == [1] and out["accuracy"] == [2] and out["accuracy_command"] == "full"
    assert out["throughput"] == [{"timed": True}] and "--rounds 7" in out["command"]
    with pytest.raises(ValueError, match="five integers"):
        qat.parse_shape("8,32,2048")


def test_next_calls_script_names_existing_switches_and_methods():
    """benchmarks/probes/next_calls.sh (the next device calls, written ahead): every ``--variant`` it times names
    switches that exist for its ``--method`` (a renamed or removed one would make variants.py refuse the step on the
    GPU), and the methods it asks of qat.py are qat.py's."""
    import re
    import shlex
    from pathlib import Path

    from benchmarks import qat, variants

    text = Path(__file__).resolve().parents[1].joinpath("benchmarks/probes/next_calls.sh").read_text()
    shell_vars = dict(re.findall(r"^(\w+)=(\S+)$", text, flags=re.M))
    words = shlex.split(re.sub(r"\$(\w+)", lambda m: shell_vars.get(m.group(1), m.group(0)),
                               text.replace("\\\n", " ")), comments=True)
    checked, method = [], None
    for i, word in enumerate(words):
        if word == "--method":
            method = words[i + 1]
        elif word == "--variant":
            _, assignments = variants.parse_variant(words[i + 1])
            variants.apply(assignments, only_check=True, method=method)
            checked.append((method, words[i + 1].split("=")[0]))
    assert checked == [("qat", "committed"), ("qat", "lop3"), ("qat", "gmax"), ("qat", "lanes"),
                       ("sage", "committed"), ("sage", "raw")], checked
    start = words.index("--methods")
    asked = words[start + 1:start + 3]
    assert set(asked) <= set(qat.method_fns(64, False, None)), asked
