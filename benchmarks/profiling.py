"""Device time per kernel from a ``jax.profiler`` trace (no TensorBoard needed).

``profile_calls(run, calls)`` traces ``calls`` invocations of ``run`` (which must block on its
result) and reads the XSpace with :class:`jax.profiler.ProfileData`: every event on a GPU
plane's stream lines is a kernel (or a copy). It returns per-kernel device time per call, the
device's busy time per call (the union of all kernel intervals, so overlapping streams count
once) and the host wall time per call: busy far below wall means the host or launch gaps bound
the step, not the kernels.
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
import time
from collections.abc import Callable

import jax
from jax.profiler import ProfileData


def _device_events(path: str) -> list[tuple[str, int, int]]:
    """(name, start_ns, end_ns) of every event on the GPU planes' stream lines."""
    events = []
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            events += [(ev.name, int(ev.start_ns), int(ev.end_ns)) for ev in line.events]
    return events


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def profile_calls(run: Callable[[], object], calls: int = 5) -> dict:
    """Trace ``calls`` calls of ``run`` (warmed up by the caller).

    Returns a dict: ``kernels`` {name: (ms per call, launches per call)}, sorted by time;
    ``busy_ms`` (union of kernel intervals per call); ``kernel_ms`` (sum of kernel times per
    call); ``wall_ms`` (host time per call, including the trace's own overhead).
    """
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            t0 = time.perf_counter()
            for _ in range(calls):
                run()
            wall = (time.perf_counter() - t0) / calls
        paths = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        events = _device_events(paths[0]) if paths else []
    per = collections.defaultdict(lambda: [0, 0])
    for name, s, e in events:
        per[name][0] += e - s
        per[name][1] += 1
    kernels = {n: (ns / calls / 1e6, cnt / calls) for n, (ns, cnt) in sorted(per.items(), key=lambda kv: -kv[1][0])}
    return dict(kernels=kernels, busy_ms=_union_ns([(s, e) for _, s, e in events]) / calls / 1e6,
                kernel_ms=sum(ms for ms, _ in kernels.values()), wall_ms=wall * 1e3, calls=calls)


def group_of(name: str, groups: dict[str, tuple[str, ...]]) -> str:
    """The first group one of whose keys the lower-cased ``name`` contains, else "other"."""
    low = name.lower()
    return next((g for g, keys in groups.items() if any(k in low for k in keys)), "other")


def grouped(kernels: dict, groups: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """Sum ms per call over kernels whose lower-cased name contains one of a group's keys
    (first matching group wins; the rest goes to "other")."""
    out = collections.Counter()
    for name, (ms, _) in kernels.items():
        out[group_of(name, groups)] += ms
    return dict(out)


def kinds_in_group(kernels: dict, groups: dict[str, tuple[str, ...]], group: str = "other") -> list:
    """``[(kind, ms, count)]`` per call of the kernels in ``group``, by kind, most time first. A kernel's kind is
    its name less a trailing ``_<number>``: XLA numbers its fusions per program (``loop_convert_fusion_44``), so
    two programs' kernels compare by kind, not by name."""
    out = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (ms, count) in kernels.items():
        if group_of(name, groups) == group:
            kind = re.sub(r"_\d+$", "", name)
            out[kind][0] += ms
            out[kind][1] += count
    return sorted(((k, ms, c) for k, (ms, c) in out.items()), key=lambda row: -row[1])
