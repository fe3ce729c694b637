"""A/B timing of kernel variants that module-level switches select, each variant in a fresh process.

Usage (GPU machine, repo root):
    PYTHONPATH=. python benchmarks/variants.py \\
        --variant committed= \\
        --variant no_join=pallas_kernels.sage_bwd_mosaic.DQ_WITH_DKDV_CAUSAL=False \\
        --shape 16,10,5,2048,64,1 --shape 8,32,32,2048,64,0 --repeats 2 [--check] [--ptxas] [--method qat]
    PYTHONPATH=. python benchmarks/variants.py --smoke   # tiny shape, interpret mode off the GPU

The probes behind benchmarks/NOTES.md: each variant sets switches such as
``pallas_kernels._mosaic.SKIP_VISIBLE_TILES`` or ``pallas_kernels.sage_bwd_mosaic.DQ_WITH_DKDV_CAUSAL``
(``module.ATTR=<Python literal>``, comma-separated; an empty list is the committed code) or fields of the
method's config on top of the library's per-shape default (``config.fwd_backend='mosaic'``), runs in its own
process (nothing cached from another variant), and times one jitted fwd+bwd of ``lb.sage_attention`` or
``lb.qat_attention`` (``--part fwd``: the forward alone) per shape (B, Hq, Hkv, S, D, causal). Variants run
interleaved ``--repeats`` times, so drift of the machine shows as spread between repeats.
``--check``: each variant's o and gradients against the xla reference (rel-L1, same quantization) on the
first shape, and the forward's row outputs (the LSE; Attn-QAT's m and O′: :func:`row_outputs_check`). ``--ptxas``: ptxas's register-spill report per Mosaic GPU kernel (``MOSAIC_GPU_DUMP_PTXAS``; the
raw output goes to $OUT/ptxas_<variant>.log where $OUT is set) and stack frame (local memory per thread,
where the spills live: times the CTA's threads, the L1 they need; benchmarks/NOTES.md, eighteenth session).
``--profile``: also each shape's device busy time and its kernels' times per call (``benchmarks.profiling``, 10
traced calls), so a change to one kernel and its producers shows apart from the rest (benchmarks/NOTES.md,
thirty-second session: an XLA transpose that ate a kernel's gain), and the wall time less the busy time (forty-third
session: a 32-byte dQ stage that made a kernel 2% faster made the call slower, in that gap).
Writes benchmarks/results/variants.json (and $OUT/variants.json); not rendered into RESULTS.md.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import json
import os
import re
import subprocess
import sys
import warnings

SMOKE_SHAPE = (1, 2, 2, 128, 64, True)
PROFILE_TOP = 8  # kernels kept per shape with --profile
# ptxas -v: "Compiling entry function 'k'" then that kernel's "N bytes stack frame, M bytes spill stores" line.
# (Its "Registers are spilled ... in function 'k', M bytes spill stores" warning comes *before* k's entry line,
# so it is not matched: pairing it with the entry above gave the previous kernel k's count.)
SPILL = re.compile(r"Compiling entry function '(\w+)'|(\d+) bytes stack frame, (\d+) bytes spill stores")


def parse_assignments(text: str) -> list[tuple[str, str, object]]:
    """``"pkg.mod.ATTR=1,pkg.mod.OTHER='x'"`` → [("pkg.mod", "ATTR", 1), ("pkg.mod", "OTHER", "x")]."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        target, sep, value = item.partition("=")
        module, _, attr = target.rpartition(".")
        if not sep or not module or not attr:
            raise ValueError(f"expected module.ATTR=value, got {item!r}")
        try:
            literal = ast.literal_eval(value)
        except (ValueError, SyntaxError) as err:
            raise ValueError(f"{item!r}: the value must be a Python literal") from err
        out.append((module, attr, literal))
    return out


def parse_variant(text: str) -> tuple[str, list]:
    """``"name=assignments"`` (assignments as :func:`parse_assignments`; empty: the committed code)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--variant must be name=assignments, got {text!r}")
    return name, parse_assignments(rest)


def parse_shape(text: str) -> tuple[int, int, int, int, int, bool]:
    """``"B,Hq,Hkv,S,D,causal"`` (causal 0/1) → a tuple."""
    parts = [int(p) for p in text.split(",")]
    if len(parts) != 6:
        raise ValueError(f"--shape needs B,Hq,Hkv,S,D,causal, got {text!r}")
    return (*parts[:5], bool(parts[5]))


#: the pseudo-module of assignments to the method's config (``config.fwd_backend='mosaic'``)
CONFIG = "config"


def config_fields(method: str) -> tuple[str, ...]:
    """The fields that ``config.FIELD=value`` may set: those of SageFwdConfig or QatConfig."""
    import dataclasses

    from pallas_kernels import configs
    return tuple(f.name for f in dataclasses.fields(configs.SageFwdConfig if method == "sage" else configs.QatConfig))


def apply(assignments: list, *, only_check: bool = False, method: str = "sage") -> dict:
    """Set each module attribute (``only_check``: just look them up); an attribute the module lacks is
    an error, since a misspelled switch would time the committed code under another name. Assignments
    to ``config.FIELD`` are checked against the method's config and returned (field → value), to be
    applied to the library's per-shape default config."""
    overrides = {}
    for module, attr, value in assignments:
        if module == CONFIG:
            if attr not in config_fields(method):
                raise AttributeError(f"the {method} config has no field {attr!r}")
            overrides[attr] = value
            continue
        mod = importlib.import_module(module)
        if not hasattr(mod, attr):
            raise AttributeError(f"{module} has no attribute {attr!r}")
        if not only_check:
            setattr(mod, attr, value)
    return overrides


def lowering_probe_args(description: str, argv=None, *, head_dim: int = 64) -> argparse.Namespace:
    """The command line of a probe that lowers one fwd+bwd of a method's Mosaic kernels on the CPU
    (``benchmarks/probes/transfer_plans.py``, ``barrier_census.py``): ``--method``, ``--head-dim``, ``--causal`` and
    ``--assign`` (module switches, set here; config fields are refused, as the probes lower the library's config)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--method", choices=("sage", "qat"), default="sage")
    parser.add_argument("--head-dim", type=int, choices=(64, 128), default=head_dim)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--assign", default="", help="module.ATTR=value switches, as benchmarks/variants.py's")
    args = parser.parse_args(argv)
    if apply(parse_assignments(args.assign), method=args.method):
        parser.error("--assign takes module switches only (config fields are not applied here)")
    return args


def child(args) -> dict:
    """One variant in this process: set its switches, then time (and check) every shape."""
    import dataclasses

    import jax

    import lowbit_jax as lb
    from benchmarks.attention import make_inputs
    from benchmarks.attention_bwd import fwd_bwd
    from benchmarks.common import time_fn
    from benchmarks.profiling import profile_calls

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    overrides = apply(parse_assignments(args.assign), method=args.method)
    interpret = jax.default_backend() != "gpu"
    attend = {"sage": lb.sage_attention, "qat": lb.qat_attention}[args.method]
    default_config = {"sage": lb.sage_fwd_config, "qat": lb.qat_config}[args.method]
    result = {"ms": {}, "check": None, **({"busy_ms": {}, "kernels": {}} if args.profile else {})}

    def jitted(fn):  # (q, k, v, do) → (o,) or (o, dq, dk, dv)
        return jax.jit(lambda q, k, v, do: (fn(q, k, v),)) if args.part == "fwd" else fwd_bwd(fn)

    for i, shape in enumerate(json.loads(args.shapes)):
        b, hq, hkv, s, d, causal = shape
        q, k, v = make_inputs(jax.random.key(0), b, hq, s, d)  # the inputs of dq_kernel.py's timings
        k, v = k[:, :, :hkv], v[:, :, :hkv]
        do = jax.random.normal(jax.random.key(1), q.shape, q.dtype)
        config = dataclasses.replace(default_config(d, bool(causal)), **overrides)
        fn = functools.partial(attend, causal=bool(causal), interpret=interpret, config=config)
        run = jitted(fn)
        if args.check and i == 0:
            ref_fn = functools.partial(attend, causal=bool(causal), implementation="xla", config=config)
            ref = jitted(ref_fn)(q, k, v, do)
            got = run(q, k, v, do)
            result["check"] = {name: float(lb.rel_l1(a, r)) for name, a, r in zip(("o", "dq", "dk", "dv"), got, ref)}
            result["check"].update(row_outputs_check(args.method, q, k, v, causal=bool(causal), config=config,
                                                     interpret=interpret))
        timing = dict(warmup=1, iters=1, batches=1) if interpret else {}
        key = ",".join(map(str, shape))
        result["ms"][key] = time_fn(run, q, k, v, do, **timing)
        if args.profile:
            prof = profile_calls(lambda: jax.block_until_ready(run(q, k, v, do)), 1 if interpret else 10)
            result["busy_ms"][key] = prof["busy_ms"]
            result["kernels"][key] = {name: ms for name, (ms, _) in list(prof["kernels"].items())[:PROFILE_TOP]}
    return result


def row_outputs_check(method: str, q, k, v, *, causal: bool, config, interpret: bool) -> dict[str, float]:
    """rel-L1 of the forward's row outputs against the xla reference's: the LSE (and Attn-QAT's m and O′), which
    only the backward reads, so a forward-only check of o misses them (benchmarks/NOTES.md, thirty-fifth session:
    a three-warpgroup forward's LSE stores landed in the next head's rows while o matched)."""
    import jax.numpy as jnp

    import lowbit_jax as lb
    from lowbit_jax import qat

    def forward(implementation):
        if method == "sage":
            _, lse, _ = lb.sage_forward(q, k, v, causal=causal, config=config, implementation=implementation,
                                        interpret=interpret)
            return {"lse": lse}
        opts = qat.resolve_qat_options(q, k, v, causal=causal, config=config, implementation=implementation,
                                       interpret=interpret)
        _, o_aux, lse, m, _ = qat.qat_forward(q, k, v, opts=opts, with_aux=True)
        return {"o_aux": o_aux, "lse": lse, "m": m}

    def rel_l1(a, r):  # rows that see no key have an LSE of +inf in both: compared as a pattern, not in the sum
        finite = jnp.isfinite(r)
        if bool(jnp.any(jnp.isfinite(a) != finite)):
            return float("inf")
        return float(lb.rel_l1(jnp.where(finite, a, 0), jnp.where(finite, r, 0)))

    got, ref = forward("pallas"), forward("xla")
    return {name: rel_l1(got[name], ref[name]) for name in got}


def spills(log: str, *, stack_frame: bool = False) -> dict[str, int]:
    """ptxas's spill-store bytes per compiled kernel (the largest seen for each name) from its -v output;
    ``stack_frame``: the stack frame instead (bytes of local memory per thread, where spills live)."""
    out, current = {}, None
    for match in SPILL.finditer(log):
        if match.group(1):
            current = match.group(1)
        elif current is not None:
            out[current] = max(out.get(current, 0), int(match.group(2 if stack_frame else 3)))
    return out


def run_variant(name: str, assign: str, shapes: list, method: str, check: bool, ptxas: bool, part: str = "fwd_bwd",
                env: dict[str, str] | None = None, profile: bool = False, timeout: float | None = None) -> dict:
    """One variant in a fresh child process (its ``RESULT`` dict); ``env``: extra environment variables for it
    (``benchmarks/sass_census.py`` sets the Mosaic GPU dump switches); ``timeout``: seconds before the child is
    killed and RuntimeError raised (a kernel variant that deadlocks)."""
    cmd = [sys.executable, __file__, "--child", "--assign", assign, "--shapes", json.dumps(shapes),
           "--method", method, "--part", part] + (["--check"] if check else []) + (["--profile"] if profile else [])
    env = dict(os.environ, **(env or {}), **({"MOSAIC_GPU_DUMP_PTXAS": "1"} if ptxas else {}))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"variant {name} ran past {timeout} s (a hang?)") from err
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"variant {name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    if ptxas:
        result["spill_bytes"] = spills(proc.stdout + proc.stderr)
        result["stack_frame_bytes"] = spills(proc.stdout + proc.stderr, stack_frame=True)
        if os.environ.get("OUT"):  # the raw log, to read which kernel a spill report follows
            with open(os.path.join(os.environ["OUT"], f"ptxas_{name}.log"), "a") as f:
                f.write(proc.stdout + proc.stderr)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ASSIGNMENTS")
    parser.add_argument("--shape", action="append", default=[], metavar="B,Hq,Hkv,S,D,CAUSAL")
    parser.add_argument("--method", choices=("sage", "qat"), default="sage")
    parser.add_argument("--part", choices=("fwd_bwd", "fwd"), default="fwd_bwd",
                        help="time the forward and backward (default) or the forward alone")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="gradients vs the xla reference on the first shape")
    parser.add_argument("--ptxas", action="store_true", help="ptxas's spill report per kernel (GPU)")
    parser.add_argument("--profile", action="store_true", help="device busy time and per-kernel times per shape")
    parser.add_argument("--child-timeout", type=float, default=None,
                        help="seconds per variant process; one that fails or runs past it is reported and skipped")
    parser.add_argument("--smoke", action="store_true", help="one tiny shape, the committed code, one repeat")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--assign", default="", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", default="[]", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    from benchmarks.common import environment, write_json

    variants = [parse_variant(v) for v in args.variant] or [("committed", [])]
    shapes = [parse_shape(s) for s in args.shape] or ([SMOKE_SHAPE] if args.smoke else [])
    if not shapes:
        parser.error("give at least one --shape (or --smoke)")
    for _, assignments in variants:  # fail here, not after minutes of timing, on a misspelled switch
        apply(assignments, only_check=True, method=args.method)
    payload = dict(env=environment(), command="PYTHONPATH=. python benchmarks/variants.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), method=args.method, part=args.part, shapes=shapes, runs=[])
    for repeat in range(1 if args.smoke else args.repeats):
        for name, assignments in variants:
            assign = ",".join(f"{m}.{a}={v!r}" for m, a, v in assignments)
            try:
                result = run_variant(name, assign, shapes, args.method, args.check and repeat == 0, args.ptxas,
                                     args.part, profile=args.profile, timeout=args.child_timeout)
            except RuntimeError as err:
                if args.child_timeout is None:
                    raise
                print(f"{name:>16} #{repeat}: skipped: {str(err)[-1500:]}", flush=True)
                payload["runs"].append(dict(variant=name, assign=assign, repeat=repeat, error=str(err)[-1500:]))
                continue
            payload["runs"].append(dict(variant=name, assign=assign, repeat=repeat, **result))
            print(f"{name:>16} #{repeat}: " + "  ".join(f"[{k}] {ms:.3f} ms" for k, ms in result["ms"].items())
                  + (f"  check {result['check']}" if result.get("check") else "")
                  + (f"  spills {result['spill_bytes']}" if result.get("spill_bytes") else "")
                  + (f"  stack frames {result['stack_frame_bytes']}" if result.get("stack_frame_bytes") else ""),
                  flush=True)
            for key, kernels in result.get("kernels", {}).items():
                # the wall time the device is not busy: a kernel-time gain can hide a loss there (forty-third session)
                gap = result["ms"][key] - result["busy_ms"][key]
                print(f"{'':>16}    [{key}] busy {result['busy_ms'][key]:.3f} ms (wall − busy {gap:.3f}): "
                      + "  ".join(f"{k[:32]} {ms:.4f}" for k, ms in kernels.items()), flush=True)
            write_json("variants_smoke" if args.smoke else "variants", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
