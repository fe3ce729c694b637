"""Regenerate benchmarks/RESULTS.md from benchmarks/results/*.json (never typed by hand).

    python benchmarks/render_results.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
METHODS = ["sage", "sage_kernel_only", "cudnn_bf16", "cudnn_fp8", "pallas_mha_bf16", "xla_bf16"]


def _f(x, fmt="{:.0f}"):
    return "–" if x is None else fmt.format(x)


def _provenance(data: dict) -> str:
    """'Device …, jax …, date' of a results file."""
    env = data["env"]
    return f"Device {env['device']}, jax {env['jax']}, {env['date']}"


def _command_block(data: dict) -> list[str]:
    """Provenance line (and how long it ran, where the file says) and the commands that produced a results file, as
    an indented block."""
    commands = data.get("commands", [data["command"]])
    took = f", {data['seconds'] / 60:.0f} min" if "seconds" in data else ""
    where = "GPU machine" if data["env"].get("platform") == "gpu" else data["env"].get("platform", "")
    return [f"{_provenance(data)}{took}. Command{'s' if len(commands) > 1 else ''} (repo root, {where}):", "",
            *(f"    {c.strip()}" for c in commands), ""]


def _rounds_note(rows: list[dict]) -> list[str]:
    """A line saying how the rows' times were taken when they came from interleaved rounds
    (``common.time_rounds``), else nothing (older files timed each method once, one after the other)."""
    rounds = {r.get("rounds", 1) for r in rows}
    if rounds == {1}:
        return []
    n = "/".join(str(x) for x in sorted(rounds))
    warmups = sorted({r["warmup"] for r in rows if "warmup" in r})
    before = (f", each timed batch after {'/'.join(map(str, warmups))} untimed calls of the same entry"
              if warmups else "")
    return [f"Every method of a row timed in {n} interleaved rounds (each method once per round{before}); the median "
            "is shown.", ""]


def render_quant_sweep(data: dict) -> list[str]:
    """The quantize kernels by warps (``attention.py --quant-sweep``): ms and GB/s per shape and kernel, the
    config's choice (``sage_fwd_config`` on the device that ran) in bold."""
    rows = data["rows"]
    warps = sorted({r["warps"] for r in rows})
    out = ["## SageAttention quantize kernels by warps", "", *_command_block(data),
           "Each kernel alone: ms and GB/s of the bytes it reads and writes (16-bit in, INT8 out). `kv` writes "
           "K̂ and V̂ᵀ (the forward's), `kv + K̂ᵀ` also the backward's K̂ᵀ. In bold: the warps "
           "`sage_fwd_config` picks (`quant_warps` for Q, `kv_quant_warps` for K/V).", "",
           "| B, H, S, D | kernel | " + " | ".join(f"{w} warps" for w in warps) + " |",
           "|---|---|" + "---|" * len(warps)]
    from pallas_kernels.configs import sage_fwd_config

    by_key: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        by_key.setdefault((r["b"], r["h"], r["s"], r["d"], r["kernel"]), {})[r["warps"]] = r
    for key, by_warps in by_key.items():
        cfg = sage_fwd_config(key[3], False, data["env"]["device"])
        chosen = cfg.quant_warps if key[4] == "q" else cfg.kv_quant_warps
        cells = [f"{by_warps[w]['ms']:.3f} ({by_warps[w]['gbps']:.0f})" if w in by_warps else "" for w in warps]
        cells = [f"**{c}**" if c and w == chosen else c for c, w in zip(cells, warps)]
        out.append(f"| {', '.join(map(str, key[:4]))} | {key[4]} | " + " | ".join(cells) + " |")
    return out + [""]


def render_pv_formats(data: dict) -> list[str]:
    """The Sage op with INT8 vs e4m3 P·V (``attention.py --pv-formats``): ms and the ratio to cuDNN bf16 (> 1:
    faster), forward and fwd+bwd; then the cos-sim of each against exact attention."""
    rounds = sorted({r["rounds"] for r in data["rows"]})
    out = ["## SageAttention: INT8 or e4m3 P·V (whole op)", "", *_command_block(data),
           f"Whole op, quantization included, the device's `sage_fwd_config` with `pv_format` set; cuDNN bf16 in "
           f"the same {'/'.join(map(str, rounds))} interleaved rounds (medians). Cells: ms (× cuDNN, > 1 is faster).",
           "", "| B, H, S, D, causal | cuDNN fwd | INT8 fwd | e4m3 fwd | cuDNN fwd+bwd | INT8 fwd+bwd | e4m3 fwd+bwd |",
           "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        ms = r["ms"]
        cell = lambda name, base: f"{ms[name]:.3f} ({ms[base] / ms[name]:.2f}×)"  # noqa: E731
        out.append(f"| {r['b']}, {r['h']}, {r['s']}, {r['d']}, {'causal' if r['causal'] else 'full'} | "
                   f"{ms['cudnn']:.3f} | {cell('int8', 'cudnn')} | {cell('e4m3', 'cudnn')} | "
                   f"{ms['cudnn fwd+bwd']:.3f} | {cell('int8 fwd+bwd', 'cudnn fwd+bwd')} | "
                   f"{cell('e4m3 fwd+bwd', 'cudnn fwd+bwd')} |")
    out += ["", "Cos-sim against exact float64 attention (gates: O ≥ 0.999, dV ≥ 0.998, dQ and dK ≥ 0.99):", "",
            "| B, H, S, D | K outlier | causal | P·V | O | dQ | dK | dV |", "|---|---|---|---|---|---|---|---|"]
    for a in data.get("accuracy", []):
        c = a["cos"]
        out.append(f"| {a['b']}, {a['h']}, {a['s']}, {a['d']} | {a['k_outlier']:g} | {a['causal']} | "
                   f"{a['pv_format']} | {c['o']:.5f} | {c['dq']:.5f} | {c['dk']:.5f} | {c['dv']:.5f} |")
    return out + [""]


def render_attention(data: dict) -> list[str]:
    out = [
        "## INT8 SageAttention forward",
        "",
        *_command_block(data),
        "TFLOP/s (TOP/s for INT8) count 4·B·H·S²·D, halved if causal, for every method; "
        "times are per call with calls queued back to back (device time). "
        "`sage` is the whole op (the K-mean/V-amax pass + fused quantize kernels + attention kernel); "
        "`kernel` is the attention kernel the op runs (`mosaic` in the tiles column: the Mosaic GPU forward), "
        "alone on pre-quantized operands; "
        "`quant ms` the quantization alone. bf16 inputs, layout (B, S, H, D).",
        *_superseded(data),
        "",
        "| B | H | S | D | causal | sage | kernel | cuDNN bf16 | cuDNN FP8 | Pallas mha bf16 | XLA bf16 "
        "| sage / cuDNN | kernel / cuDNN | quant ms | tiles |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["throughput"]:
        tf, ratio = r["tflops"], r["vs_cudnn_bf16"]
        cfg = r["config"]
        out.append(
            f"| {r['b']} | {r['h']} | {r['s']} | {r['d']} | {r['causal']}{_carried_mark(r)} | "
            + " | ".join(_f(tf.get(m)) for m in METHODS)
            + f" | **{_f(ratio.get('sage'), '{:.2f}')}×** | {_f(ratio.get('sage_kernel_only'), '{:.2f}')}× | "
            f"{_f(r.get('sage_quantize_only'), '{:.3f}')} | "
            f"{cfg['block_q']}×{cfg['block_k']} w{cfg['num_warps']} s{cfg['num_stages']}"
            + (" (kernel: mosaic)" if r.get("kernel_backend") == "mosaic" else "") + " |"
        )
    out += _carried_footnote(data, data["throughput"])
    out += ["", "### Accuracy vs exact fp32 attention (B4 H32 S4096 D128, bf16 inputs)", "",
            "| inputs | causal | method | cos-sim | rel-L1 | rel-L2 |", "|---|---|---|---|---|---|"]
    for r in data["accuracy"]:
        if "cos_sim" in r:
            out.append(f"| {r['inputs']} | {r['causal']} | {r['method']} | {r['cos_sim']:.5f} | "
                       f"{r['rel_l1']:.4f} | {r['rel_l2']:.4f} |")
    out += ["", "`k_outlier_10x`: K plus a per-(batch, head, channel) mean drawn with 10× the std of K. "
            "`kernel vs xla-ref` compares the compiled kernels with the pure-JAX reference of the same "
            "quantization (agreement up to accumulation order and exp2)."]
    sweep = data.get("sweep") or _load("attention_sweep") or {}
    if sweep and not data.get("sweep"):
        out += ["", f"The sweep below is from an earlier run ({sweep['env']['date']}, "
                f"`{sweep['command'].strip()}`, host-synchronised per-call timing); its winners are "
                "the default of `sage_fwd_config` in pallas_kernels/configs.py."]
        sweep = sweep["sweep"]
    if sweep:
        out += ["", "### Tile sweep (attention kernel alone)", "", "| shape | tiles | ms | TOP/s |",
                "|---|---|---|---|"]
        for r in sweep:
            c = r["config"]
            out.append(f"| B{r['b']} H{r['h']} S{r['s']} D{r['d']} causal={r['causal']} | "
                       f"{c['block_q']}×{c['block_k']} w{c['num_warps']} s{c['num_stages']} | "
                       f"{r['ms']:.3f} | {r['tops']:.0f} |")
    if data.get("checks"):
        worst = max(r["kernel_vs_xla"]["rel_l1"] for r in data["checks"])
        out += ["", f"Compiled-kernel checks on awkward shapes (ragged, GQA/MQA, causal Sq≠Sk, per-token, "
                f"Q-smoothing): {len(data['checks'])} cases, worst kernel-vs-reference rel-L1 {worst:.1e}, "
                f"NaN in none: {not any(r['nan'] for r in data['checks'])}"
                + (f" (run apart from the table: `{data['checks_command']}`, {data.get('checks_date', '')})."
                   if data.get("checks_command") else ".")]
        out += ["", data["checks_note"]] if data.get("checks_note") else []
    return out


BWD_COLUMNS = ("sage", "sage_triton", "sage_mosaic", "sage_mosaic_all", "sage_ds_row", "cudnn_bf16",
               "pallas_mha_bf16", "pallas_mgpu_bf16", "xla_bf16")


def render_backward(data: dict) -> list[str]:
    out = ["", "## SageBwd: fwd+bwd (INT8 backward)", "", *_command_block(data),
           "One jitted `jax.vjp` + pullback per method; TFLOP/s count 3.5× the forward's 4·B·H·S²·D (halved if "
           "causal). bf16 inputs. Backward tiles: the config's defaults (dK/dV 64×64, 4 warps, 2 stages; dQ 64×64, 4 "
           "warps, 3 stages — what `--dq-tiles 64,4,3` asks for; sweeps below). `sage` is the library's defaults "
           "(`dkdv_backend`/`dq_backend` = auto: both backward kernels on Mosaic GPU where they apply, the table "
           "\"SageBwd kernel backends\" below; `dq_kernel` = auto: dQ fused into the dK/dV kernel, the table "
           "\"dQ inside the dK/dV kernel\"; `fwd_backend` = auto: the Mosaic forward on Hopper); "
           "`sage (Triton)` and `sage (Mosaic)` put both backward kernels on one backend "
           "with the Triton forward, `sage (all Mosaic)` the forward too; `dS per row` is the defaults with "
           "`ds_scale=\"row\"` (a dash: not run in that measurement).", "", *_rounds_note(data.get("throughput", [])),
           "| B | H | S | D | causal | sage ms | sage | sage (Triton) | sage (Mosaic) | sage (all Mosaic) | dS per row "
           "| cuDNN bf16 | Pallas mha bf16 | Pallas Mosaic GPU bf16 | XLA bf16 | sage / cuDNN |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data.get("throughput", []):
        tf = r["tflops"]
        out.append(f"| {r['b']} | {r['h']} | {r['s']} | {r['d']} | {r['causal']} | {_f(r['ms'].get('sage'), '{:.2f}')} | "
                   + " | ".join(_f(tf.get(m)) for m in BWD_COLUMNS)
                   + f" | **{_f(r['vs_cudnn_bf16'].get('sage'), '{:.2f}')}×** |")
    if data.get("note"):
        out += ["", data["note"]]
    if data.get("memory"):
        heading = "Peak GPU memory of one fwd+bwd, fresh process each (`memory_stats()['peak_bytes_in_use']`"
        heading += f"; `{data['memory_command']}`, {data['memory_date']}" if data.get("memory_command") else ""
        heading += f"; from the run of {data['memory_from']}, not this one" if data.get("memory_from") else ""
        temps = any(r.get("temp_bytes") for r in data["memory"])
        heading += ("; in brackets the compiled step's XLA temp buffers, `compiled.memory_analysis()`: at the peak "
                    "they are live beside the step's arguments and outputs" if temps else "")
        out += ["", heading + "):", "",
                "| shape | setting | sage | cuDNN bf16 |", "|---|---|---|---|"]

        def cell(r, m):
            peak, temp = r["peak_bytes"].get(m), r.get("temp_bytes", {}).get(m)
            return _f(peak and peak / 2**30, "{:.2f} GiB") + (f" (temp {temp / 2**30:.2f})" if temp is not None else "")

        for r in data["memory"]:
            setting = r.get("what", "q, k, v are the step's inputs")
            out.append(f"| B{r['b']} H{r['h']} S{r['s']} D{r['d']} causal={r['causal']} | {setting} | "
                       f"{cell(r, 'sage')} | {cell(r, 'cudnn_bf16')} |")
        if data.get("memory_note"):
            out += ["", data["memory_note"]]
    if data.get("error_reports"):
        r0 = data["error_reports"][0]
        since = f"; from the run of {data['error_reports_from']}" if data.get("error_reports_from") else ""
        out += ["", f"### Error of each intermediate vs exact fp32 (B{r0['b']} H{r0['h']} S{r0['s']} D{r0['d']}, "
                f"non-causal; cos-sim / rel-L2; `lowbit_jax.diagnostics.attention_error_report`{since})", "",
                "| inputs | variant | " + " | ".join(r0["report"]) + " |",
                "|---|---|" + "---|" * len(r0["report"])]
        for r in data["error_reports"]:
            out.append(f"| {r['inputs']} | {r['variant']} | " + " | ".join(
                f"{m['cos_sim']:.4f} / {m['rel_l2']:.3f}" for m in r["report"].values()) + " |")
        out += ["| SageBwd paper (real activations) | | .9969 / .079 | | | | .9789 / .205 | .9664 / .258 | "
                ".9537 / .307 | .9985 / .054 |"]
    if data.get("gradient_checks"):
        heading = "Compiled kernels vs the xla reference (same quantization), gradients, on awkward shapes"
        if data.get("gradient_checks_command"):
            heading += (f" (run apart from the table above: `{data['gradient_checks_command']}`, "
                        f"{data.get('gradient_checks_date', '')})")
        out += ["", heading + ":", "",
                "| case (B, Sq, Sk, Hq, Hkv, D, causal) | granularity | Q-smoothing | kernels | dQ / dK / dV rel-L1 vs "
                "xla | dQ / dK / dV cos-sim vs exact |", "|---|---|---|---|---|---|"]
        for r in data["gradient_checks"]:
            if "error" in r:
                out.append(f"| {tuple(r['case'])} | {r['gran']} | {r['smooth_q']} | {r.get('backend', 'default')} | "
                           f"FAILED: `{r['error'][:120]}` | |")
                continue
            out.append(f"| {tuple(r['case'])} | {r['gran']} | {r['smooth_q']} | {r.get('backend', 'default')} | "
                       + " / ".join(
                f"{r[n]['kernel_vs_xla']['rel_l1']:.1e}" for n in ("dq", "dk", "dv")) + " | " + " / ".join(
                f"{r[n]['kernel_vs_exact']['cos_sim']:.5f}" for n in ("dq", "dk", "dv")) + " |")
    return out + _superseded(data)


def render_backward_sweep(data: dict, title: str = "SageBwd tile sweep") -> list[str]:
    out = ["", f"### {title} (backward kernels alone, from the forward's residuals)", "",
           f"{data['env']['date']}, `{data['command'].strip()}`. TOP/s count 2.5× the forward's FLOPs."]
    if data.get("note"):
        out += ["", data["note"]]
    out += ["", "| shape | forward tiles | backward tiles | warps | stages | dQ | code | ms | TOP/s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        c = r["config"]
        out.append(f"| B{r['b']} H{r['h']} S{r['s']} D{r['d']} causal={r['causal']} | {c['fwd'][0]}×{c['fwd'][1]} | "
                   f"{c['bwd'][0]}×{c['bwd'][1]} | {c['warps']} | {c['stages']} | {_dq(c.get('dq', 'separate'))} | "
                   f"{r.get('code', '')} | {_f(r.get('bwd_ms'), '{:.2f}')} | {_f(r.get('bwd_tflops'))} |")
    return out


def render_backend_splits(data: dict) -> list[str]:
    names = ["triton", "mosaic", "dkdv_triton_dq_mosaic", "dkdv_mosaic_dq_triton", "auto"]
    out = ["", "### SageBwd kernel backends (the table behind `dkdv_backend`/`dq_backend` = \"auto\")", "",
           f"{_provenance(data)}, `{data['command'].strip()}`. fwd+bwd ms (Triton forward in all columns); "
           "bf16, layout (B, S, H, D); the fastest sage column in bold.", "",
           "| B | S | Hq/Hkv | D | causal | cuDNN bf16 | all Triton | all Mosaic | dK/dV Triton + dQ Mosaic "
           "| dK/dV Mosaic + dQ Triton | auto |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    out[3:3] = [*_superseded(data)[1:], ""] if data.get("superseded") else []
    for r in data["rows"]:
        ms = r["ms"]
        best = min((ms[n] for n in names[:-1] if n in ms), default=None)
        cells = [(f"**{ms[n]:.2f}**" if ms.get(n) == best else _f(ms.get(n), "{:.2f}")) for n in names]
        out.append(f"| {r['b']} | {r['s']} | {r['hq']}/{r['hkv']} | {r['d']} | {r['causal']} | "
                   f"{_f(ms.get('cudnn_bf16'), '{:.2f}')} | " + " | ".join(cells) + " |")
    return out


def _dq(dq) -> str:
    """The dQ column: a mode name, or the dQ kernel's (key tile, warps, stages)."""
    return dq if isinstance(dq, str) else f"{dq[0]} keys w{dq[1]} s{dq[2]}"


def _qat_throughput_table(rows: list[dict]) -> list[str]:
    """The Attn-QAT throughput rows as a table whose columns are the methods some row has."""
    pp = "qat_mosaic_pingpong"
    names = {"qat": "qat", "qat_mosaic": "mosaic", pp: "mosaic+pp", "qat_naive_bwd": "qat naive", "sage": "sage",
             "cudnn_bf16": "cuDNN bf16"}
    present = lambda kind, m: any(m in r[f"{kind}_tflops"] for r in rows)  # noqa: E731
    fwd = [m for m in ("qat", "qat_mosaic", pp, "sage", "cudnn_bf16") if present("fwd", m)]
    fwd_ratio = [m for m in ("qat_mosaic", pp) if present("fwd", m) and present("fwd", "cudnn_bf16")]
    fb = [m for m in ("qat", "qat_mosaic", pp, "qat_naive_bwd", "sage", "cudnn_bf16") if present("fwd_bwd", m)]
    fb_ratio = [m for m in ("qat", "qat_mosaic", pp) if present("fwd_bwd", m) and present("fwd_bwd", "cudnn_bf16")]
    heads = ([("fwd: " if i == 0 else "") + names[m] for i, m in enumerate(fwd)]
             + [f"{names[m]} / cuDNN" for m in fwd_ratio]
             + [("fwd+bwd: " if i == 0 else "") + names[m] for i, m in enumerate(fb)]
             + [f"**{names[m]} / cuDNN**" for m in fb_ratio])
    out = ["| B | H | S | D | causal | " + " | ".join(heads) + " |", "|---" * (5 + len(heads)) + "|"]
    for r in rows:
        cells = ([_f(r["fwd_tflops"].get(m)) for m in fwd]
                 + [f"{_f(r['fwd_vs_cudnn_bf16'].get(m), '{:.2f}')}×" for m in fwd_ratio]
                 + [_f(r["fwd_bwd_tflops"].get(m)) for m in fb]
                 # three decimals: #4's 0.8× target is decided by the third (0.796× read as 0.80×)
                 + [f"**{_f(r['fwd_bwd_vs_cudnn_bf16'].get(m), '{:.3f}')}×**" for m in fb_ratio])
        out.append(f"| {r['b']} | {r['h']} | {r['s']} | {r['d']} | {r['causal']} | " + " | ".join(cells) + " |")
    return out


def render_qat(data: dict, sweep: dict | None) -> list[str]:
    out = ["", "## Attn-QAT (NVFP4 fake-quantized attention)", "", *_command_block(data),
           "TFLOP/s count 4·B·H·S²·D (halved if causal), fwd+bwd 3.5× that, for every method. bf16 inputs. "
           "The H200 has no FP4 tensor cores: FP4 is emulated (fake-quantized values, bf16 MMAs), so the cost is "
           "the in-register quantization of P plus the extra O' product. `qat naive` = FP4 forward with the "
           "mismatched 16-bit backward (ablation). `qat` runs the Triton kernels, `mosaic` the Pallas Mosaic GPU ones "
           "(`QatConfig(fwd_backend=\"mosaic\", bwd_backend=\"mosaic\")`, what the default \"auto\" picks on "
           "Hopper) without and `mosaic+pp` with the forward's ping-pong schedule (`QatConfig.pingpong`, the "
           "default). The Mosaic columns and the accuracy rows run the library's config for the device "
           "(`lb.qat_config`), the Triton column `QatConfig()`'s tiles. Columns of methods the run did not time "
           "(`qat.py --methods`) are left out.",
           "", *_rounds_note(data.get("throughput", [])),
           *_qat_throughput_table(data.get("throughput", []))]
    if data.get("accuracy"):
        r0 = data["accuracy"][0]
        out += ["", f"### Accuracy vs exact fp32 (B{r0['b']} H{r0['h']} S{r0['s']} D{r0['d']}, N(0,1), non-causal; "
                "cos-sim / rel-L2)", "", "| inputs | variant | O | dQ | dK | dV |", "|---|---|---|---|---|---|"]
        for r in data["accuracy"]:
            out.append(f"| {r.get('inputs', 'normal')} | {r['variant']} | " + " | ".join(
                f"{r['metrics'][n]['cos_sim']:.4f} / {r['metrics'][n]['rel_l2']:.3f}" for n in ("o", "dq", "dk", "dv"))
                + " |")
        out += ["| | Attn-QAT paper (≈) | 0.98 | 0.98 | 0.98 | 0.98 |"]
    for backend in ("triton", "mosaic", "mosaic_pingpong"):
        checks = [r for r in data.get("kernel_checks", []) if r.get("backend", "triton") == backend]
        failed = [r for r in checks if "error" in r]
        checks = [r for r in checks if "error" not in r]
        for r in failed:
            out += ["", f"Compiled {backend} kernels FAILED on {tuple(r['case'])}: `{r['error']}`"]
        if checks:
            worst = max(r[n]["rel_l1"] for r in checks for n in ("o", "dq", "dk", "dv"))
            out += ["", f"Compiled {backend} kernels vs the xla twin on awkward shapes (ragged, GQA/MQA, causal "
                    f"Sq≠Sk): {len(checks)} cases, O and gradients, worst rel-L1 {worst:.1e}."]
    if sweep:
        out += ["", f"### Tile sweep ({sweep['env']['date']}, `{sweep['command'].strip()}`, B4 H32 S4096 D128)", "",
                "| part | tiles (bq×bk w s) | ms | TFLOP/s |", "|---|---|---|---|"]
        for r in sweep["sweep"]:
            t = r["tile"]
            out.append(f"| {r['kind']} | {t[0]}×{t[1]} w{t[2]} s{t[3]} | {r['ms']:.2f} | {r['tflops']:.0f} |")
        out += ["", "(fwd+bwd rows vary the backward tiles with the best forward tiles.)", *_superseded(sweep)]
    return out + _superseded(data)


def render_qat_training(runs: list[dict]) -> list[str]:
    out = ["", "### Training comparison: 16-bit vs FP4 forward + naive backward vs Attn-QAT", ""]
    for data in runs:
        out += [f"{data['title']} ({data['env']['device']}, {data['env']['date']}): `{data['command'].strip()}` → "
                f"`{data['plot']}`", "", "| variant | final train loss | final val loss | diverged |",
                "|---|---|---|---|"]
        for label, s in data["summary"].items():
            out.append(f"| {label} | {_f(s.get('final_loss'), '{:.4f}')} | {_f(s.get('final_val_loss'), '{:.4f}')} | "
                       f"{s.get('diverged_at', 'no')} |")
        out += [""]
    return out


def render_training(data: dict) -> list[str]:
    r0 = data["rows"][0]
    out = ["", f"## Training step throughput, preset {r0['preset']} (dense vs sage attention, same run)", "",
           f"{_provenance(data)}. Command: `{data['command'].strip()}`. Jitted train step (fwd + bwd + AdamW, bf16 compute), "
           "MFU = (6·N + 6·L·S·d) FLOPs per token × tokens/s / 989 TFLOP/s. dense = cuDNN flash attention."
           + " sage: the model hands q and k to `sage_attention` before QK-norm and RoPE (`lb.QKPrologue`: the "
             "norm and rotation inside its quantize kernels, their backward one Triton pass; "
             "`ModelConfig.fuse_qk_prologue`); qat_fp4 likewise to `qat_attention`, the norm and rotation inside "
             "its fake-quantization kernel."
           + (" `METHOD~unfused`: the same model with QK-norm and RoPE computed by XLA (the rows of earlier runs)."
              if any("~unfused" in r["method"] for r in data["rows"]) else "")
           + (f" Median of {data['rounds']} interleaved windows of {data['steps_per_round']} steps; the ratio to "
              "dense is the median of the per-round ratios." if data.get("rounds") else
              " One window of timed steps per method, back to back."), "",
           "| method | params | batch × seq | ms / step | tokens/s | MFU | step temp memory |",
           "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        temp = r.get("temp_bytes")
        out.append(f"| {r['method']} | {r['params'] / 1e6:.1f}M | {r['batch']} × {r['seq']} | {r['step_ms']:.1f} | "
                   f"{r['tokens_per_s']:,.0f} | {_f(r['mfu'] and 100 * r['mfu'], '{:.1f}%')} | "
                   f"{'–' if temp is None else f'{temp / 2**30:.2f} GiB'} |")
    if any(r.get("temp_bytes") is not None for r in data["rows"]):
        out += ["", "Step temp memory: the compiled step's XLA temporaries (`memory_analysis().temp_size_in_bytes`: "
                "activations, attention residuals, workspaces; parameters and optimizer state not included). "
                "`METHOD@block` / `@dots`: `ModelConfig.remat`, the blocks recomputed in the backward "
                "(everything / all but the matmul outputs)."]
    ratios = data.get("vs_dense") or {"sage": data["sage_vs_dense"]}
    is_dense = lambda m: m.partition("@")[0] == "dense"  # noqa: E731
    out += ["", "tokens/s relative to dense (a `METHOD@REMAT` row relative to `dense@REMAT`): " + ", ".join(
        f"{m} **{r:.2f}**" for m, r in ratios.items() if not is_dense(m))]
    if data.get("vs_dense_rounds"):
        out += ["", "Per-round ratios (each round times every method back to back): " + "; ".join(
            f"{m} " + " ".join(f"{x:.2f}" for x in rs) for m, rs in data["vs_dense_rounds"].items() if not is_dense(m))
            + ". Dense alone went from " + "{:.1f} to {:.1f} ms/step within the run.".format(
                *[(r["step_ms_rounds"][0], r["step_ms_rounds"][-1]) for r in data["rows"]
                  if r["method"] == "dense"][0])]
    if data.get("note"):
        out += ["", data["note"]]
    return out + _superseded(data)


def render_data_parallel(data: dict) -> list[str]:
    n = data["devices"]
    out = ["", f"## Data-parallel training on {n} GPUs (`jax.shard_map` around the step)", "",
           *_command_block(data),
           f"Preset {data['preset']}, S{data['seq']}, bf16 compute, the library's kernels inside the shard_map'd step "
           f"(`train.parallel`), {n} × {', '.join(data['device_kinds'])}.", "",
           f"Agreement: the same start and the same global batches for {data['agreement'][0]['steps']} steps on one "
           f"device and on {n}; relative differences, largest over the steps (the parameter updates p − p₀ after the "
           "last step). \"1 vs 1\" is a second one-device run: atomics in the backward kernels make one device "
           "alone not bit-reproducible, so that is the floor.", "",
           f"| method | global batch | loss, 1 vs {n} | loss, 1 vs 1 | grad norm, 1 vs {n} | grad norm, 1 vs 1 | "
           f"updates, 1 vs {n} | updates, 1 vs 1 |", "|---|---|---|---|---|---|---|---|"]
    for r in data["agreement"]:
        out.append(f"| {r['method']} | {r['global_batch']} | {r['loss_rel_diff']:.1e} | {r['loss_rel_diff_noise']:.1e} | "
                   f"{r['grad_norm_rel_diff']:.1e} | {r['grad_norm_rel_diff_noise']:.1e} | "
                   f"{r['update_rel_diff']:.1e} | {r['update_rel_diff_noise']:.1e} |")
    out += ["", f"Throughput, weak scaling (the same sequences per device; median of {data['rounds']} interleaved windows "
            f"of {data['steps_per_round']} steps; efficiency = tokens/s on {n} ÷ ({n} × tokens/s on 1)):", "",
            f"| method | sequences per device | ms / step, 1 GPU | ms / step, {n} GPUs | tokens/s, 1 GPU | "
            f"tokens/s, {n} GPUs | efficiency |", "|---|---|---|---|---|---|---|"]
    for r in data["throughput"]:
        out.append(f"| {r['method']} | {r['per_device_batch']} | {r['step_ms_one']:.1f} | {r['step_ms_many']:.1f} | "
                   f"{r['tokens_per_s_one']:,.0f} | {r['tokens_per_s_many']:,.0f} | **{r['efficiency']:.2f}** |")
    return out + _superseded(data)


def render_ablation(data: dict) -> list[str]:
    sh = data["shape"]
    out = ["", "## Where the time goes (kernels with one piece patched out)", "",
           f"{_provenance(data)}. Command: `{data['command'].strip()}`. B{sh['b']} H{sh['h']} S{sh['s']} D{sh['d']}, non-causal, bf16. The patched "
           "variants compute wrong outputs on purpose: the differences are what each piece costs.", "",
           "| variant | ms |", "|---|---|"]
    out += [f"| {r['variant']} | {r['ms']:.3f} |" for r in data["rows"]]
    return out


def render_dq_kernel(data: dict) -> list[str]:
    out = ["", "## dQ inside the dK/dV kernel (`dq_kernel`: fused vs separate)", "",
           *_command_block(data),
           "fwd+bwd ms (TFLOP/s at 3.5× the forward's FLOPs, ratio to cuDNN bf16), one jitted `jax.vjp` + pullback; "
           "bf16, layout (B, S, H, D). `separate`: the dQ kernel recomputes S, P and dP; `fused`: the dK/dV kernel "
           "reduce-adds each step's dS·K into a float32 dQ with TMA. `sage separate` runs the library's default "
           "backends with the dQ kernel; `sage fused` runs the Mosaic dK/dV kernel (per-block Q/K scales, per-tile "
           "dS). The library default (`dq_kernel=\"auto\"`) is fused everywhere; at D128 Attn-QAT's fused dQ is "
           "split by columns between the kernel's two warpgroups (`qat_bwd_mosaic.splits_dq_columns`).", "",
           "| B | Hq/Hkv | S | D | causal | cuDNN bf16 | sage separate | sage fused | qat separate | qat fused |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        b, h, hkv, s, d, causal = r["shape"]
        ms, ref = r["ms"], r["ms"].get("cudnn")

        def cell(name):
            t = ms.get(name)
            if t is None:
                return "–"
            ratio = f", {ref / t:.2f}×" if ref else ""
            return f"{t:.2f} ({r['tflops'][name]:.0f}{ratio})"

        out.append(f"| {b} | {h}/{hkv} | {s} | {d} | {causal}{_carried_mark(r)} | {cell('cudnn')} | "
                   f"{cell('sage_separate')} | {cell('sage_fused')} | {cell('qat_separate')} | {cell('qat_fused')} |")
    out += _carried_footnote(data, data["rows"] + data["checks"],
                             default="the kernels of those shapes did not change in between.")
    out += ["", "Compiled gradients (dQ / dK / dV rel-L1): fused vs separate, and each vs the xla reference "
            "(same quantization).", "",
            "| case (B, Sq, Sk, Hq, Hkv, D, causal) | method | fused vs separate | fused vs xla | separate vs xla |",
            "|---|---|---|---|---|"]
    fmt = lambda xs: " / ".join(f"{x:.1e}" for x in xs)  # noqa: E731
    for c in data["checks"]:
        out.append(f"| {tuple(c['case'])}{_carried_mark(c)} | {c['method']} | {fmt(c['fused_vs_separate'])} | "
                   f"{fmt(c['fused_vs_xla'])} | {fmt(c['separate_vs_xla'])} |")
    return out + _superseded(data)


def render_breakdown(data: dict) -> list[str]:
    out = ["", "## Where the time goes, by device kernel (profiler trace)", "", *_command_block(data),
           "Device time per kernel from a `jax.profiler` trace (`benchmarks/profiling.py`). busy = the union of "
           "kernel intervals, wall = host time; groups sum kernels by name (attention: the library's Pallas kernels "
           "and cuDNN's; matmul: cuBLAS/nvjet; other: XLA fusions). sage and qat run the library's defaults for the "
           "device (`lb.sage_fwd_config`, `lb.qat_config`)."]
    tr = data.get("training")
    if tr:
        out += ["", f"Training step, preset {tr['preset']}, B{tr['batch']} S{tr['seq']}, {tr['steps']} steps per "
                "round, last round per step:", "",
                "| method | wall ms | busy ms | attention | matmul | other | kernels / step |", "|---|---|---|---|---|---|---|"]
        for m, rounds in tr["rounds"].items():
            r = rounds[-1]
            g = r["groups"]
            out.append(f"| {m} | {r['wall_ms']:.1f} | {r['busy_ms']:.1f} | {g.get('attention', 0):.1f} | "
                       f"{g.get('matmul', 0):.1f} | {g.get('other', 0):.1f} | {r['launches']:.0f} |")
        for m, rounds in tr["rounds"].items():
            out += ["", f"Largest kernels per step, {m}: " + "; ".join(
                f"`{n[:60]}` {ms:.2f} ms ×{c:.0f}" for n, ms, c in rounds[-1]["top"][:6])]
        out += _other_kinds_table(tr["rounds"])
    if data.get("attention"):
        since = f" (from the run of {data['attention_from']}, not this one)" if data.get("attention_from") else ""
        out += ["", f"One attention fwd+bwd (`jax.vjp` + pullback), per kernel{since}:", "",
                "| B, Hq/Hkv, S, D, causal | method | busy ms | kernels (ms) |", "|---|---|---|---|"]
        for r in data["attention"]:
            b, hq, hkv, s, d, causal = r["shape"]
            kernels = ", ".join(f"`{n[:48]}` {ms:.3f}" for n, ms, _ in r["top"][:5])
            out.append(f"| {b}, {hq}/{hkv}, {s}, {d}, {causal} | {r['method']} | {r['busy_ms']:.3f} | {kernels} |")
    return out + _superseded(data)


def kinds_by_spread(per_method: dict[str, dict[str, float]]) -> list[str]:
    """The kinds of ``benchmarks.profiling.kinds_in_group`` ({method: {kind: ms}}), the one whose times differ
    most between the methods first (a kind a method lacks counts 0 ms there); ties by name. Kept here, where no jax
    is imported, so that breakdown.py's log and this module's table share it."""
    methods = list(per_method)
    times = lambda k: [per_method[m].get(k, 0.0) for m in methods]  # noqa: E731
    return sorted({k for per in per_method.values() for k in per}, key=lambda k: (min(times(k)) - max(times(k)), k))


def _other_kinds_table(rounds: dict, top: int = 8) -> list[str]:
    """The "other" kernels by kind (``breakdown.py``'s ``other_kinds``), ms per step in the last round, one column
    per method, the kinds whose times differ most between methods first; [] for runs that did not keep them."""
    kinds = {m: {k: ms for k, ms, _ in r[-1].get("other_kinds", [])} for m, r in rounds.items()}
    if not any(kinds.values()):
        return []
    names = kinds_by_spread(kinds)
    methods = list(kinds)
    out = ["", f"\"Other\" kernels by kind (the name less XLA's fusion number), ms per step, the {top} that differ "
           "most between methods:", "", "| kind | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for k in names[:top]:
        out.append(f"| `{k}` | " + " | ".join(f"{kinds[m].get(k, 0.0):.3f}" for m in methods) + " |")
    return out


def render_thrift(data: dict) -> list[str]:
    """ThriftAttention: kernel checks, accuracy (gap recovered), prefill and decode timings."""
    lines = ["## ThriftAttention (FP4/16-bit mixed precision, inference)", ""] + _command_block(data)
    lines += [*_superseded(data)[1:], ""] if data.get("superseded") else []
    lines += _other_runs(data, "Section")
    checks = data.get("checks", [])
    if checks:
        worst = max(r["o"]["rel_l1"] for r in checks if "o" in r)
        mism = sum(r.get("selection_mismatches", 0) for r in checks)
        failed = [str(tuple(r["case"])) for r in checks if "error" in r]
        lines += [f"Compiled kernels vs the xla twin on {len(checks)} awkward shapes (ragged, causal Sq ≠ Sk, GQA/MQA, "
                  f"D64/D128, prefill and decode): O rel-L1 ≤ {worst:.1e}, selection mismatches {mism}"
                  + (f"; failed: {', '.join(failed)}" if failed else "") + ".", ""]
    acc = data.get("accuracy", [])
    if acc:
        r0 = acc[0]
        lines += [f"**Accuracy** (B{r0['b']} H{r0['hq']}/{r0['hkv']} S{r0['s']} D{r0['d']} causal, O vs exact fp32; "
                  "gap recovered = (err(f=0) − err(f)) / (err(f=0) − err(f=1)), err = rel-L2; the paper's anchor on "
                  "real models: 89.1% at f = 0.05):", "",
                  "| inputs | budget f | rel-L2 | cos-sim | gap recovered |", "| --- | --- | --- | --- | --- |"]
        for r in acc:
            gap = "–" if r["gap_recovered"] is None else f"{r['gap_recovered']:.1%}"
            lines.append(f"| {r['inputs']} | {r['budget']:g} | {r['metrics']['rel_l2']:.4f} | "
                         f"{r['metrics']['cos_sim']:.5f} | {gap} |")
        lines += ["", "\"heavy\": a direction shared by the queries and by the keys of the first block and 1% of the "
                  "others (where attention concentrates, as with sinks and retrieved spans); \"normal\": N(0,1), where "
                  "no block matters more than another.", ""]
    pre = data.get("prefill", [])
    if pre:
        cols = list(pre[0]["ms"])
        lines += ["**Prefill** (whole op: selection kernel + operand pass + prefill kernel; ms, ratio = cuDNN bf16 "
                  "time / time):", "",
                  "| shape | " + " | ".join(cols) + " | parts at f=0.05 (select / operands / kernel) |",
                  "| --- |" + " --- |" * (len(cols) + 1)]
        for r in pre:
            cells = [f"{r['ms'][c]:.2f} ({r['vs_cudnn_bf16'].get(c, 0):.2f}×)" if c in r["ms"] else "–" for c in cols]
            parts = r.get("parts_ms") or {}
            part = " / ".join(f"{parts[k]:.2f}" for k in ("select", "operands", "prefill_kernel") if k in parts) or "–"
            lines.append(f"| B{r['b']} H{r['hq']}/{r['hkv']} S{r['s']} D{r['d']}{' causal' if r['causal'] else ''} | "
                         + " | ".join(cells) + f" | {part} |")
        lines.append("")
    for r in data.get("long", []):
        ratio = r["ms"]["cudnn_bf16"] / r["ms"]["thrift_f0.05"] if "cudnn_bf16" in r["ms"] else 0
        lines += [f"**Long prefill** B{r['b']} H{r['hq']}/{r['hkv']} S{r['s']} D{r['d']}"
                  f"{' causal' if r['causal'] else ''}, f = 0.05: " + ", ".join(
                      f"{m} {t:.1f} ms (XLA temporaries {r['temp_mib'][m]:.0f} MiB)" for m, t in r["ms"].items())
                  + f"; {ratio:.2f}× cuDNN; q, k, v take {r['args_mib']:.0f} MiB.", ""]
    dec = data.get("decode", [])
    if dec:
        lines += ["**Decode** (T new tokens per sequence over a full cache, T = 1 unless the shape says; ms, bytes "
                  "moved per second — for thrift the K/V codes, scales and 16-bit blocks it reads plus the block "
                  "means, the query and the split-KV partial outputs written and read back, for the bf16 methods "
                  "the whole K and V —, rel-L2 of O vs exact on heavy-hitter inputs; "
                  "thrift_f<budget>_s<4-bit splits>_h<16-bit splits>" + (
                      ", \"_triton\" with one Triton kernel for both kinds of run (the others: the Mosaic GPU "
                      "kernel for the 4-bit runs on Hopper)" if any(m.endswith("_triton") for r in dec for m in r["ms"])
                      else "") + "; f = 1 is the 16-bit path alone; "
                  "xla_bf16 and cudnn_bf16: `jax.nn.dot_product_attention` over the 16-bit cache, XLA's over all "
                  "of it, cuDNN's over the filled length (`key_value_seq_lengths`; for T > 1 without the causal "
                  "mask among the new tokens, so a timing baseline only)" + (
                      f"; each figure the median of {dec[0]['rounds']} rounds that time every variant in turn"
                      if dec[0].get("rounds", 1) > 1 else "") + (
                      f", {dec[0]['calls_per_dispatch']} steps a dispatch (one step takes about what the host needs "
                      "to dispatch it)" if dec[0].get("calls_per_dispatch", 1) > 1 else "") + "):", "",
                  "| shape | variant | ms | vs XLA bf16 | vs cuDNN bf16 | GB/s | rel-L2 |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in dec:
            shape = f"B{r['b']} H{r['hq']}/{r['hkv']} S{r['s']} D{r['d']}" + (
                f" T{r['t']}" if r.get("t", 1) > 1 else "")
            vs_cudnn = r.get("vs_cudnn_bf16") or {}
            for m, t in r["ms"].items():
                vs_xla = r["vs_xla_bf16"].get(m)
                lines.append(f"| {shape} | {m} | {t:.3f} | " + (f"{vs_xla:.2f}× | " if vs_xla else "– | ")
                             + (f"{vs_cudnn[m]:.2f}× | " if m in vs_cudnn else "– | ")
                             + f"{r['gbps'].get(m, 0):.0f} | {r['error_vs_exact'][m]['rel_l2']:.4f} |")
        alone = [f"{m} at B{r['b']} H{r['hq']}/{r['hkv']} S{r['s']} D{r['d']}"
                 + (f" T{r['t']}" if r.get("t", 1) > 1 else "") + f" {t:.3f} ms"
                 for r in dec for m, t in r.get("kernel_ms", {}).items()]
        b16, b4 = dec[0]["cache_bytes"]["16bit"], dec[0]["cache_bytes"]["4bit"]
        kernels = (f"The split-KV kernels and their merge kernel alone (selection and row layout outside): "
                   f"{'; '.join(alone)}. " if alone else "")
        lines += ["", kernels + f"Cache: the 4-bit part adds {b4 / b16:.1%} to the 16-bit one (plus the block means).",
                  ""]
    sweep = data.get("sweep", [])
    pre_sweep = [r for r in sweep if r.get("kind", "prefill") == "prefill"]
    # runs before decode_sweep was its own section kept the decode rows in "sweep" (one token each)
    dec_sweep = data.get("decode_sweep") or [r for r in sweep if r.get("kind") == "decode"]
    if pre_sweep:
        lines += ["Prefill launch sweep at f = 0.05 (B1 S16384 causal): " + ", ".join(
            f"w{r['num_warps']} s{r['num_stages']} {r['ms']:.2f} ms" for r in pre_sweep) + ".", ""]
    if dec_sweep:
        launches = list(dict.fromkeys((r["warps"], r["stages"]) for r in dec_sweep))
        case = lambda r: (r["b"], r["s"], r.get("tokens", 1), r["budget"])  # noqa: E731
        cases = list(dict.fromkeys(map(case, dec_sweep)))
        ms = {case(r) + (r["warps"], r["stages"]): r["kernel_ms"] for r in dec_sweep}
        lines += ["Decode kernel launch sweep (kernel alone, ms; T new tokens × a group of 4 heads = the query "
                  "rows; warps w, stages s):", "",
                  "| shape | T | f | " + " | ".join(f"w{w} s{s}" for w, s in launches) + " |",
                  "| --- | --- | --- |" + " --- |" * len(launches)]
        lines += [f"| B{b} S{s} | {t} | {f:g} | " + " | ".join(
            f"{ms[(b, s, t, f, w, st)]:.3f}" if (b, s, t, f, w, st) in ms else "–" for w, st in launches) + " |"
            for b, s, t, f in cases] + [""]
    wgs_rows = data.get("decode_wgs", [])
    if wgs_rows:
        lines += render_decode_wgs(wgs_rows)
    return lines


def render_decode_wgs(rows: list[dict]) -> list[str]:
    """The ``decode_wgs`` section of thrift.json: the Mosaic decode kernel by compute warpgroups a CTA."""
    wgs = sorted({int(w) for r in rows for w in r["max_abs_vs_1"]})
    lines = ["Decode by compute warpgroups a CTA of the Mosaic 4-bit kernel (`ThriftConfig.decode_compute_wgs`; more "
             "than one behind a producer warpgroup), f = 0.05, GQA: ms per step of the whole op and of the split-KV "
             "kernels with their merge alone, ratio = cuDNN bf16 decode / ours; max |O − O(1 warpgroup)|:", "",
             "| shape | cuDNN bf16 | " + " | ".join(f"op, {w} wg | kernels, {w} wg" for w in wgs) + " | max diff |",
             "| --- | --- |" + " --- | --- |" * len(wgs) + " --- |"]
    for r in rows:
        ms, ratio = r["ms"], r.get("vs_cudnn_bf16", {})

        def cell(name):
            if name not in ms:
                return "–"
            return f"{ms[name]:.4f}" + (f" ({ratio[name]:.2f}×)" if name in ratio else "")

        diffs = ", ".join(f"{w}: {v:.1e}" for w, v in r["max_abs_vs_1"].items() if v is not None and int(w) > 1)
        lines.append(f"| B{r['b']} H{r['hq']}/{r['hkv']} S{r['s']} D{r['d']} T{r['t']} | {cell('cudnn_bf16')} | "
                     + " | ".join(f"{cell(f'op wgs{w}')} | {cell(f'kernels wgs{w}')}" for w in wgs)
                     + f" | {diffs or '–'} |")
    return lines + [""]


def render_dq_schedule(data: dict) -> list[str]:
    """benchmarks/dq_schedule.py: the fused dQ's scheduling knobs at head dim 128."""
    names = list(dict.fromkeys(n for r in data["rows"] for n in r["ms"] if n != "cudnn_bf16"))
    lines = ["", "## The fused dQ's schedule at head dim 128 (`split_dq_schedule`, `dq_stage_order`)", "",
             *_command_block(data),
             "fwd+bwd ms of one jitted `jax.vjp` + pullback (bf16), each variant's speed relative to the library "
             "default (default ms / variant ms) and cuDNN bf16's ratio to the default; a variant whose gradients "
             "differ from the default's by more than 1e-3 rel-L1 is not timed.", "",
             "| method | B, H, S, D, causal | cuDNN bf16 | " + " | ".join(names) + " | gradients vs default |",
             "| --- | --- | --- |" + " --- |" * len(names) + " --- |"]
    for r in data["rows"]:
        ms, speed = r["ms"], r["speed_vs_default"]
        cells = [f"{ms[n]:.3f} ({speed[n]:.3f}×)" if n in ms else "–" for n in names]
        cudnn = f"{ms['cudnn_bf16']:.3f} ({speed['cudnn_bf16']:.2f}×)" if "cudnn_bf16" in ms else "–"
        grads = ", ".join(f"{n} {max(e):.1e}" for n, e in r["grads_vs_default"].items())
        lines.append(f"| {r['method']} | {', '.join(map(str, r['shape']))} | {cudnn} | " + " | ".join(cells)
                     + f" | {grads} |")
    return lines + [""]


def render_thrift_quality(data: dict) -> list[str]:
    """ThriftAttention on a trained model: validation loss per budget vs the model's 16-bit attention."""
    t = data.get("training") or {}
    trained = (f"a {t['params'] / 1e6:.0f}M-parameter byte-level LM (preset {t['preset']}) trained here with dense "
               f"attention at seq {t['seq']}, batch {t['batch']}, {t['steps']} steps, lr {t['lr']:g} on "
               f"`{t['corpus']}` ({t['seconds']:.0f} s, {t['tokens_per_s']:,.0f} tokens/s)" if t
               else f"the checkpoint `{data['run']}`")
    rows = data["rows"]
    ends = {r["variant"]: r["bucket_loss"] for r in rows}
    zero, one = ends.get("thrift f=0"), ends.get("thrift f=1")
    n = len(rows[0]["bucket_loss"])
    lines = ["### ThriftAttention on a trained model (validation loss per budget)", ""] + _command_block(data) + [
        f"Model: {trained}. Scored on {data['windows']} non-overlapping validation windows of {data['seq']} bytes with "
        "its own attention (dense, cuDNN) and with `method='thrift'` (the prefill kernels, every layer causal over "
        "the whole window). Δ: mean loss difference from dense ± its paired standard error over windows; gap "
        f"recovered = (L(0) − L(f)) / (L(0) − L(1)), overall and in each of {n} equal spans of positions (the "
        "paper's model-level anchor, docs/spec.md: 89.1% at f = 0.05).", "",
        "| variant | loss (nats/byte) | bits/byte | Δ vs dense | gap recovered | by position span: loss (gap "
        "recovered) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        gap = r.get("gap_recovered")
        quarters = []
        for i, x in enumerate(r["bucket_loss"]):
            part = None
            if zero and one and r["variant"].startswith("thrift") and zero[i] != one[i]:
                part = (zero[i] - x) / (zero[i] - one[i])
            quarters.append(f"{x:.4f}" + ("" if part is None else f" ({part:.0%})"))
        lines.append(f"| {r['variant']} | {r['loss']:.4f} | {r['bits_per_byte']:.4f} | "
                     f"{r['delta']:+.5f} ± {r['delta_stderr']:.5f} | {'–' if gap is None else f'{gap:.1%}'} | "
                     + " / ".join(quarters) + " |")
    return lines + [""]


def render_serving(data: dict) -> list[str]:
    """The model's decode step over a long cache (benchmarks/serving.py): dense vs ThriftAttention."""
    rows = data["rows"]
    r0 = rows[0]
    lines = ["### The model's decode step: dense vs ThriftAttention (benchmarks/serving.py)", ""] + _command_block(data) + [
        f"Preset {r0['preset']} ({r0['params'] / 1e6:.0f}M parameters, {r0['layers']} layers, {r0['heads']}/"
        f"{r0['kv_heads']} heads of {r0['head_dim']}), random parameters, bf16. One jitted `TransformerLM.decode` "
        "step per generated token (one new token per sequence, greedy pick included), the caches donated; caches "
        "filled with the same random K/V; each figure the median of "
        f"{r0['rounds']} rounds of {r0['steps']} steps that time every method in turn. dense: the model's 16-bit "
        "decode (`lowbit_jax.cached_attention`: cuDNN over the filled length for one token); thrift f: "
        "`lowbit_jax.thrift_decode` "
        "(split-KV), f = 1 its 16-bit path alone (every complete block from the 16-bit cache).", "",
        "| batch | cache tokens | method | ms / step | tokens/s | vs dense |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for name, ms in r["ms"].items():
            lines.append(f"| {r['batch']} | {r['length']} | {name} | {ms:.3f} | {r['tokens_per_s'][name]:,.0f} | "
                         f"{r['vs_dense'][name]:.2f}× |")
    return lines + [""]


def render_serving_prefill(data: dict) -> list[str]:
    """A prompt through the KV cache (benchmarks/serving.py --prefill): the op by implementation, then the model."""
    lines = ["### A prompt through the KV cache: cuDNN vs XLA (benchmarks/serving.py --prefill)", ""] + _command_block(
        data) + [
        "`lowbit_jax.cached_attention` of T new bf16 tokens at `start` over a cache of S slots (the slots after "
        "start + T hold garbage); cudnn: a prompt into an empty cache is cuDNN's causal attention over the first T "
        "slots; after cached tokens two cuDNN calls (over the cached keys, and causal over the new ones) merged by "
        "their float32 log-sum-exps; xla: "
        "the masked attention over the whole cache in chunks of at most 2**26 scores. rel-L2 of O vs the float32 "
        "computation; temporaries: the compiled XLA temporaries.", "",
        "| B | T | start | S | heads | D | cudnn ms | xla ms | speed-up | cudnn / xla temp MiB | rel-L2 cudnn / xla "
        "| max abs diff |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["ops"]:
        ms, tm, e = r["ms"], r["temp_mib"], r["rel_l2"]
        lines.append(f"| {r['batch']} | {r['tokens']} | {r['start']} | {r['slots']} | {r['heads']}/{r['kv_heads']} | "
                     f"{r['head_dim']} | {ms['cudnn']:.3f} | {ms['xla']:.3f} | {ms['xla'] / ms['cudnn']:.1f}× | "
                     f"{tm['cudnn']:.0f} / {tm['xla']:.0f} | {e['cudnn']:.1e} / {e['xla']:.1e} | "
                     f"{r['max_abs_between']:.1e} |")
    for r in data.get("models", []):
        lines += ["", f"A {r['prompt']}-token prompt into the model's empty caches of {r['slots']} slots (preset "
                  f"{r['preset']}, {r['params'] / 1e6:.0f}M parameters, {r['heads']}/{r['kv_heads']} heads of "
                  f"{r['head_dim']}, B{r['batch']}, random parameters): `prefill` (the static empty-cache route, "
                  "`train.generate`'s), `decode` from `init_cache` in the same jit (dense: the cuDNN route for any "
                  "cache, with a one-slot part of weight 0; thrift: its run-time switch), the route before "
                  "(dense: XLA's masked attention over the cache; thrift: thrift_decode calls), and the forward pass "
                  "over the same tokens (no cache written). Each jitted with the greedy pick, one call at a time and "
                  "waited for: ms the median of 5, the first call's seconds with compilation; logits max |diff| vs "
                  f"the method's forward (logits reach {r['logits_max_abs']:.2f}):", "",
                  "| route | ms | prompt tokens/s | first call s | logits max abs diff vs the forward |",
                  "| --- | --- | --- | --- | --- |"]
        for name, ms in r["ms"].items():
            lines.append(f"| {name} | {ms:.2f} | {r['tokens_per_s'][name]:,.0f} | {r['first_call_s'][name]:.1f} | "
                         f"{r['logits_max_abs_vs_forward'][name]:.3f} |")
    return lines + [""]


def render_headline(data: dict) -> list[str]:
    """The README's table: each method against cuDNN's bf16 attention, and its accuracy (benchmarks/headline.py)."""
    out = ["## Headline: each method vs cuDNN bf16", "", *_command_block(data), *_other_runs(data, "Part"),
           "Ratio = cuDNN's time / ours (above 1: faster), both timed in the same interleaved rounds; fwd is the "
           "whole op (quantization included), fwd+bwd one jitted `jax.vjp` + pullback. bf16 inputs, layout "
           "(B, S, H, D).", ""]
    if data.get("training"):
        out += ["| B | H | S | D | causal | cuDNN fwd ms | sage fwd | qat fwd | cuDNN fwd+bwd ms | sage fwd+bwd "
                "| qat fwd+bwd |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in data["training"]:
            b, h, s, d, causal = r["shape"]
            ms = r["ms"]
            out.append(f"| {b} | {h} | {s} | {d} | {causal} | {ms['cudnn_bf16 fwd']:.3f} | "
                       f"{r['sage fwd ratio']:.2f}× | {r['qat fwd ratio']:.2f}× | {ms['cudnn_bf16 fwd+bwd']:.3f} | "
                       f"{r['sage fwd+bwd ratio']:.2f}× | {r['qat fwd+bwd ratio']:.2f}× |")
    if data.get("decode"):
        out += ["", "ThriftAttention decode, one new token over a full cache (GQA 32/8, D128, f = 0.05) vs cuDNN's "
                "bf16 decode over the same cache:", "", "| B | cache tokens | cuDNN ms | thrift ms | ratio |",
                "|---|---|---|---|---|"]
        for r in data["decode"]:
            out.append(f"| {r['shape'][0]} | {r['shape'][1]} | {r['ms']['cudnn_bf16']:.3f} | "
                       f"{r['ms']['thrift f=0.05']:.3f} | {r['ratio']:.2f}× |")
    if data.get("accuracy"):
        out += ["", "Cos-sim against exact float32 attention (B1 H8 S4096 D128; `k_outlier`: K plus a per-channel "
                "offset 10× its std):", "", "| inputs | method | O | dQ | dK | dV |", "|---|---|---|---|---|---|"]
        for r in data["accuracy"]:
            out.append(f"| {r['inputs']} | {r['method']} | " + " | ".join(
                f"{r[f'cos {n}']:.4f}" for n in ("O", "dQ", "dK", "dV")) + " |")
    return out + [""]


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def render_paper(data: dict) -> list[str]:
    """Paper vs ours (benchmarks/paper.py): each paper's claim, our number on the same measure, and a sentence."""
    out = ["## Paper vs ours (benchmarks/paper.py)", ""]

    if "thrift" in data:
        d = data["thrift"]
        rows = d["rows"]
        out += [f"### ThriftAttention on {d['model']} ({d['mode']}, {d['env']['device']})", "", *_command_block(d),
                f"**Paper:** {d['paper']}", "",
                f"Loss (nats/token) on {2 * d['windows_per_text']} window(s) per context (Python sources and their "
                "documentation), FP4 → 16-bit gap recovered = (L(f=0) − L(f)) / (L(f=0) − L(f=1)); sparse: the same "
                "selected pairs in 16-bit, the rest dropped.", "",
                "| context | L(0) all FP4 | L(1) all 16-bit | f | thrift loss | thrift recovered | sparse loss | "
                "sparse recovered |", "|---|---|---|---|---|---|---|---|"]
        for ctx in sorted({r["context"] for r in rows}):
            at = {(r["method"], r["budget"]): r for r in rows if r["context"] == ctx}
            for f in sorted(b for m, b in at if m == "sparse"):
                t, sp = at["thrift", f], at["sparse", f]
                out.append(f"| {ctx} | {at['thrift', 0.0]['loss']:.4f} | {at['thrift', 1.0]['loss']:.4f} | {f:g} | "
                           f"{t['loss']:.4f} | {_pct(t['gap_recovered'])} | {sp['loss']:.4f} | "
                           f"{_pct(sp['gap_recovered'])} |")
        out += [""]
    if "qat" in data:
        d = data["qat"]
        out += [f"### Attn-QAT on {d['model']} ({d['mode']}, {d['env']['device']})", "", *_command_block(d),
                f"**Paper:** {d['paper']}", "",
                f"Held-out documentation loss (nats/token) with FP4 attention and with 16-bit attention; before: the "
                f"pretrained weights (post-training quantization); after: {d['steps']} steps of continued training "
                f"(seq {d['seq']}, batch {d['batch']}, lr {d['lr']:g}) on Python sources. Recovered = share of the "
                "PTQ gap (FP4 − 16-bit before training) closed.", "",
                "| run | FP4 attention | 16-bit attention | PTQ gap recovered | max grad norm |",
                "|---|---|---|---|---|",
                f"| pretrained, no training | {d['before']['fp4']:.4f} | {d['before']['16-bit']:.4f} | — | — |"]
        for label, r in d["runs"].items():
            out.append(f"| {label} | {r['fp4']:.4f} | {r['16-bit']:.4f} | {_pct(r['gap_recovered'])} | "
                       f"{max(r['grad_norms']):.3g} |")
        out += [""]
    for key, title, group in (("qat-lr", "The naive backward's instability", "lr"),
                              ("sagebwd", "SageBwd pretraining", "tokens_per_step")):
        if key not in data:
            continue
        d = data[key]
        out += [f"### {title} (preset {d['preset']}, {d['mode']}, {d['env']['device']})", "", *_command_block(d),
                f"**Paper:** {d['paper']}", "", f"| {group} | variant | final train loss | val loss | max grad norm | "
                "diverged at |", "|---|---|---|---|---|---|"]
        for r in d["runs"]:
            val = "—" if r["val_loss"] is None else f"{r['val_loss']:.4f}"
            out.append(f"| {r[group]:g} | {r['variant']} | {r['final_loss']:.4f} | {val} | {r['max_grad_norm']:.3g} | "
                       f"{r['diverged_at'] or '—'} |")
        out += [""]
    from benchmarks.paper import PARTS, verdict

    out += ["### Agreement", ""] + [f"- **{part}:** {verdict(part, data[part])}" for part in PARTS if part in data]
    return out + [""]


def render_headline_decode(data: dict) -> list[str]:
    """The headline's decode rows run again on their own (``headline.py --parts decode --name headline_decode``):
    the decode's current default against cuDNN, when it changed after the table above was measured."""
    out = ["### Thrift decode at the current default", "", *_command_block(data),
           *([data["note"], ""] if data.get("note") else []),
           *([*_superseded(data)[1:], ""] if data.get("superseded") else []),
           "| B | cache tokens | cuDNN ms | thrift ms | ratio |", "|---|---|---|---|---|"]
    for r in data["decode"]:
        out.append(f"| {r['shape'][0]} | {r['shape'][1]} | {r['ms']['cudnn_bf16']:.3f} | "
                   f"{r['ms']['thrift f=0.05']:.3f} | {r['ratio']:.2f}× |")
    return out + [""]


def render_headline_before(now: dict, base: dict) -> list[str]:
    """The headline's timings of this tree beside an older tree's (``headline_base.json``), back to back on one
    machine: did a change cost speed on finite inputs?"""
    out = ["### Before and after (the same machine, back to back)", "",
           f"The same calls on commit {base.get('tree', '(older)')}, timed right after the table above on the same "
           f"{base['env']['device']}; ms, now / before (cuDNN's own rows show the drift between the two runs):", "",
           f"    {base['command']}", "",
           "| shape | call | ms now | ms before | now / before |", "|---|---|---|---|---|"]
    for r, b in zip(now.get("training", []), base.get("training", [])):
        shape = "B{} H{} S{} D{}{}".format(*r["shape"][:4], " causal" if r["shape"][4] else "")
        for name, ms in r["ms"].items():
            out.append(f"| {shape} | {name} | {ms:.3f} | {b['ms'][name]:.3f} | {ms / b['ms'][name]:.3f} |")
    for r, b in zip(now.get("decode", []), base.get("decode", [])):
        for name, ms in r["ms"].items():
            out.append(f"| decode B{r['shape'][0]} S{r['shape'][1]} | {name} | {ms:.4f} | {b['ms'][name]:.4f} | "
                       f"{ms / b['ms'][name]:.3f} |")
    return out + [""]


def _carried_mark(row: dict) -> str:
    """The dagger (' †') after a row carried from an earlier run (its ``carried_from``), else ''."""
    return " †" if row.get("carried_from") else ""


def _carried_footnote(data: dict, rows: list[dict], default: str = "") -> list[str]:
    """The † footnote: which runs the carried ``rows`` come from and why (``data['carried_note']``)."""
    carried = sorted({r["carried_from"] for r in rows if r.get("carried_from")})
    if not carried:
        return []
    return ["", f"† from the run of {', '.join(carried)}, not this one: " + data.get("carried_note", default)]


def _other_runs(data: dict, noun: str) -> list[str]:
    """A line per earlier run whose sections a results file kept (``benchmarks.common.keep_other_sections``)."""
    later, lines = {}, []
    for section, prov in data.get("provenance", {}).items():
        if prov["env"]["date"] != data["env"]["date"] and section in data:
            later.setdefault((prov["env"]["date"], prov["command"].strip()), []).append(section)
    for (date, command), sections in sorted(later.items()):
        lines += [f"{noun}{'s' if len(sections) > 1 else ''} {', '.join(sections)} from another run ({date}): "
                  f"`{command}`.", ""]
    return lines


def _superseded(data: dict) -> list[str]:
    """A JSON's ``superseded`` note (kernels changed since it was measured, not re-run) as a paragraph."""
    return ["", f"**Superseded in part:** {data['superseded']}"] if data.get("superseded") else []


def render_activations(data: dict) -> list[str]:
    """SageAttention's error on a pretrained model's real q, k, v and dO (benchmarks/activations.py)."""
    b, s, h, d = data["shape"]
    out = ["### SageAttention on real activations (benchmarks/activations.py)", "", *_command_block(data),
           f"q, k, v (after RoPE) and dO (the next-token loss's gradient at each attention output) of {data['source']}, "
           f"{data['dtype']}, B{b} S{s} H{h}/{data['kv_shape'][2]} D{d}; cos-sim vs exact fp32 attention of causal "
           "SageAttention/SageBwd through the reference (the kernels' quantization), INT8 and e4m3 P·V; the "
           "paper's SageBwd on real activations beside them.", "",
           "| layer | INT8 O | dQ | dK | dV | e4m3 O | dQ | dK | dV |", "|---|---|---|---|---|---|---|---|---|"]

    def cells(e):
        return " | ".join(f"{e[fmt][g]:.5f}" for fmt in ("int8", "e4m3") for g in ("O", "dQ", "dK", "dV"))

    for r in data["rows"]:
        out.append(f"| {r['layer']} | {cells(r['errors'])} |")
    out += [f"| mean | {cells(data['mean'])} |", f"| worst | {cells(data['worst'])} |",
            "| paper (SageBwd) | " + " | ".join(f"{data['paper'][g]:.4f}" for g in ("O", "dQ", "dK", "dV"))
            + " | | | | |", ""]
    return out


def _load(name: str) -> dict | None:
    path = HERE / "results" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def main() -> None:
    lines = ["# Benchmark results", "", "Generated by `benchmarks/render_results.py` from `benchmarks/results/*.json`; "
             "do not edit by hand. What was tried and what it gained or lost: `docs/performance.md`.", ""]
    headline = _load("headline")
    if headline is not None:
        lines += render_headline(headline)
        base = _load("headline_base")
        if base is not None:
            lines += render_headline_before(headline, base)
    decode = _load("headline_decode")
    if decode is not None:
        lines += render_headline_decode(decode)
    sections = [("attention", render_attention), ("attention_pv_formats", render_pv_formats),
                ("attention_quant_sweep", render_quant_sweep),
                ("attention_bwd", render_backward),
                ("attention_bwd_backends", render_backend_splits),
                ("attention_bwd_sweep", render_backward_sweep),
                ("attention_bwd_dq_sweep", lambda data: render_backward_sweep(data, "SageBwd dQ-kernel tile sweep")),
                ("training", render_training), ("training_300m", render_training),
                ("data_parallel", render_data_parallel),
                ("breakdown", render_breakdown),
                ("dq_kernel", render_dq_kernel), ("dq_schedule", render_dq_schedule),
                ("qat", lambda data: render_qat(data, _load("qat_sweep"))), ("ablation", render_ablation),
                ("thrift", render_thrift), ("serving", render_serving),
                ("serving_prefill", render_serving_prefill), ("activations", render_activations)]
    for name, render in sections:
        data = _load(name)
        if data is not None:
            lines += render(data)
    for path in sorted((HERE / "results").glob("thrift_quality*.json")):  # the current code's run first
        if not path.name.endswith("_smoke.json"):
            data = json.loads(path.read_text())
            lines += render_thrift_quality(data) + _superseded(data) + ([""] if data.get("superseded") else [])
    paper = _load("paper")
    if paper is not None:
        lines += render_paper(paper)
    runs = [json.loads(p.read_text()) for p in sorted((HERE / "results").glob("qat_training*.json"))
            if not p.name.endswith("_smoke.json")]
    if runs:
        lines += render_qat_training(runs)
    (HERE / "RESULTS.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {HERE / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
