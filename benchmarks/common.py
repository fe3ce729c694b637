"""Timing, FLOP counting and result files shared by the benchmarks (GPU)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

RESULTS_DIR = Path(__file__).resolve().parent / "results"
def attention_flops(b: int, h: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """Forward FLOPs 4·B·H·Sq·Sk·D, halved if causal (fwd+bwd is 3.5× this)."""
    flops = 4.0 * b * h * sq * sk * d
    return flops / 2 if causal else flops


def fwd_bwd(fn: Callable) -> Callable:
    """jitted (q, k, v, do) → (o, dq, dk, dv): one training step's attention, ``jax.vjp`` and the pullback."""

    def run(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(do))

    return jax.jit(run)


def time_fn(fn: Callable, *args, warmup: int = 3, iters: int = 10, batches: int = 5) -> float:
    """Device time per call in ms: median over ``batches`` of ``iters`` back-to-back calls.

    Calls within a batch are queued without waiting, so host dispatch overlaps
    the GPU work and the number is the kernels' time, not launch latency.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(iters)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) * 1e3 / iters)
        del outs
    return statistics.median(times)


def compiled_entries(methods: dict[str, dict[str, tuple[Callable, tuple]]], errors: dict[str, str],
                     log: Callable[[str], None], where: str = "") -> dict[str, tuple[Callable, tuple]]:
    """Run every ``(fn, args)`` entry of each method once (compiling it) and return the entries of the methods that
    ran, merged (for :func:`time_rounds`); a method that fails is left out, its first error (a short string) put in
    ``errors[method]`` and logged (``where``: the row, for the log)."""
    timed = {}
    for method, entries in methods.items():
        try:
            for fn, args in entries.values():
                jax.block_until_ready(fn(*args))
        except Exception as e:  # noqa: BLE001
            errors[method] = f"{type(e).__name__}: {str(e)[:200]}"
            log(f"  {method} failed{where}: {errors[method]}")
            continue
        timed.update(entries)
    return timed


#: interleaved timing rounds per row (:func:`time_rounds`: every method once per round, the median kept), so that a
#: drift of the device during a row moves cuDNN's column and ours alike
ROUNDS = 3
#: untimed calls of an entry before its timed batch in each round of :func:`time_rounds`: with one, our kernels'
#: rounds spread widely after another method's calls while cuDNN's did not; five settle them
ROUND_WARMUP = 5


#: decode steps a dispatch in the decode timings (:func:`chained`): one step takes tens of µs, less than the host
#: needs to dispatch it
DECODE_CALLS = 20


def chained(fn: Callable, calls: int) -> Callable:
    """A jitted ``f(*args)`` that runs ``fn(*args)`` ``calls`` times in one ``fori_loop``, each call's first argument
    (a float array) plus zero times a value of the previous call's output, so XLA neither hoists nor merges the
    calls. For steps of tens of µs (one decode token), where back-to-back dispatches from the host take longer
    than the GPU work and :func:`time_fn` would time the host: time this and divide by ``calls``."""

    def run(first, *others):
        def body(_, carry):
            x, total = carry
            y = jax.tree_util.tree_leaves(fn(x, *others))[0].ravel()[0].astype(jnp.float32)
            return x + (y * 0).astype(x.dtype), total + y

        return jax.lax.fori_loop(0, calls, body, (first, jnp.float32(0)))

    return jax.jit(run)


def time_rounds(timed: dict[str, tuple[Callable, tuple]], rounds: int, *, calls: int = 1,
                **kw) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Each ``name: (fn, args)`` timed by :func:`time_fn` (``kw``) once per round, the entries interleaved round by
    round, so a drift of the device's clocks moves every entry alike instead of the ones timed last. ``calls`` > 1:
    each entry runs ``calls`` times a dispatch (:func:`chained`) and the figure is per call. Returns the median ms
    per entry over the rounds and each entry's per-round ms."""
    if calls > 1:
        timed = {name: (chained(fn, calls), args) for name, (fn, args) in timed.items()}
    per_round: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(rounds):
        for name, (fn, args) in timed.items():
            per_round[name].append(time_fn(fn, *args, **kw) / calls)
    return {name: statistics.median(ts) for name, ts in per_round.items()}, per_round


def temp_mib(fn: Callable, *args) -> float:
    """XLA's temporary buffers of the compiled call of a jitted ``fn`` (MiB): what it needs beyond its arguments
    and outputs."""
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def environment() -> dict:
    dev = jax.devices()[0]
    return {
        "device": dev.device_kind,
        "platform": dev.platform,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def copy_to_out(path: Path) -> None:
    """On the lent GPU, also put a results file (a plot) under $OUT so it comes back."""
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)


def read_json(name: str) -> dict:
    """benchmarks/results/<name>.json as :func:`write_json` left it, or {} if there is none (to re-run one part of a
    results file and keep the rest)."""
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def rerun_part(name: str, part: str, value, *, command: str, env: dict) -> dict:
    """The results file ``name`` (:func:`read_json`; a new one with ``env`` if there is none) with ``part`` replaced
    by ``value`` from a run of that part alone, which ``command`` and ``env``'s date record as ``<part>_command`` and
    ``<part>_date``; ``<part>_from`` and ``<part>_note``, said of an older run's part, are dropped."""
    payload = read_json(name) or dict(env=env)
    payload.update({part: value, f"{part}_command": command, f"{part}_date": env["date"]})
    for stale in (f"{part}_from", f"{part}_note"):
        payload.pop(stale, None)
    return payload


def carried_part(name: str, part: str) -> dict:
    """``part`` of the results file ``name`` with where it came from, for a run that skips re-running it:
    ``{part, <part>_command, <part>_date[, <part>_note]}``; the command and date are the file's own where the part
    came with its run ([] and None if there is no file)."""
    old = read_json(name)
    out = {part: old.get(part, []), f"{part}_command": old.get(f"{part}_command", old.get("command")),
           f"{part}_date": old.get(f"{part}_date", old.get("env", {}).get("date"))}
    if f"{part}_note" in old:
        out[f"{part}_note"] = old[f"{part}_note"]
    return out


def write_json(name: str, payload: dict) -> list[Path]:
    """Write results to benchmarks/results/<name>.json and, on the lent GPU, under $OUT."""
    paths = [RESULTS_DIR / f"{name}.json"]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / f"{name}.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1))
    return paths


def keep_other_sections(payload: dict, path, run, sections) -> dict:
    """A run of some of a script's ``sections`` keeps the others from the results file at ``path``, each with the
    provenance (env, command) of the run that measured it (``payload["provenance"]``; rendered as "from another
    run")."""
    mine = dict(env=payload["env"], command=payload["command"])
    provenance = {section: mine for section in run}
    if path.exists():
        previous = json.loads(path.read_text())
        for section in sections:
            if section not in run and section in previous:
                payload[section] = previous[section]
                provenance[section] = previous.get("provenance", {}).get(
                    section, dict(env=previous["env"], command=previous["command"]))
    return dict(payload, provenance=provenance)
