"""`StepProfiler`: torch.profiler around a stretch of a worker's steps.

Started and stopped from the frontend (`LLM.start_profile` / `LLM.stop_profile`, vLLM's names),
so the engine is profiled where it runs — the engine-core process, or each Ray worker actor —
not in the caller's process, which launches no kernel. Each worker writes one Chrome trace
(Perfetto or chrome://tracing opens it) and returns a summary: the wall time profiled, the time
its device ran anything (the union of kernel and copy intervals; the rest of the wall time the
device sat idle, waiting for the host), and the top operations by device time (CPU time on a
CPU worker).
"""

from __future__ import annotations

import bisect
import itertools
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity


class StepProfiler:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._profile: torch.profiler.profile | None = None
        self._profile_dir = Path()
        self._start = 0.0

    def start(self, profile_dir: str) -> None:
        if self._profile is not None:
            raise ValueError("a profile is already running: stop it first")
        self._profile_dir = Path(profile_dir)
        self._profile_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.start()
        self._start = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        if self._profile is None:
            raise ValueError("no profile is running: start one first")
        profile, self._profile = self._profile, None
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            torch.cuda.synchronize()  # the steps launched so far belong to this profile
        wall_s = time.perf_counter() - self._start
        profile.stop()
        trace = self._profile_dir / f"shoal-rank{self.rank}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
        profile.export_chrome_trace(str(trace))
        sort_by = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
        return {
            "rank": self.rank,
            "trace": str(trace),
            "wall_s": wall_s,
            "device_busy_s": device_busy_s(profile) if on_gpu else None,
            "device_idle": device_idle_report(profile) if on_gpu else None,
            "table": profile.key_averages().table(sort_by=sort_by, row_limit=25),
        }


def _busy_intervals(profile: torch.profiler.profile) -> list[tuple[float, float, str, str]]:
    """The union of the device's kernel and copy intervals (µs), as disjoint sorted intervals
    (the per-name tables list an eagerly launched kernel under its op as well, so sums overcount),
    each with the names of its first and last event."""
    events = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in profile.events() if e.device_type.name == "CUDA"
    )
    merged: list[tuple[float, float, str, str]] = []
    for start, end, name in events:
        if merged and start <= merged[-1][1]:
            first_start, last_end, first, _ = merged[-1]
            merged[-1] = (first_start, max(last_end, end), first, name)
        else:
            merged.append((start, end, name, name))
    return merged


def device_busy_s(profile: torch.profiler.profile) -> float:
    """Seconds in which some kernel or copy ran on the device."""
    return sum(end - start for start, end, *_ in _busy_intervals(profile)) / 1e6


# Idle stretches by length: a launch gap inside a step (< 10 µs), a wait on the host between
# kernels or steps (10 µs to 1 ms), a stall (> 1 ms).
IDLE_BUCKETS_US = (10.0, 100.0, 1000.0)


def device_idle_report(profile: torch.profiler.profile, num_longest: int = 8) -> str:
    """Where the device sat idle between its first and last kernel: count and total time of the
    idle stretches in each bucket of IDLE_BUCKETS_US, so a host-bound stretch shows apart from
    launch gaps; then the longest few, each with when it began (ms after the first kernel) and
    the kernels on either side."""
    busy = _busy_intervals(profile)
    gaps = [later[0] - earlier[1] for earlier, later in itertools.pairwise(busy)]
    longest = sorted(range(len(gaps)), key=gaps.__getitem__, reverse=True)[:num_longest]
    edges = (0.0, *IDLE_BUCKETS_US, float("inf"))
    parts = []
    for low, high in itertools.pairwise(edges):
        chosen = [g for g in gaps if low <= g < high]
        label = f">= {low:g} us" if high == float("inf") else f"{low:g}-{high:g} us"
        parts.append(f"{label}: {len(chosen)} gaps, {sum(chosen) / 1e3:.1f} ms")
    lines = ["device idle between kernels by gap length: " + "; ".join(parts)]
    host_ops = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in profile.events() if e.device_type.name == "CPU"
    )
    for i in longest:
        start, end = busy[i][1], busy[i + 1][0]
        at_ms, before, after = (start - busy[0][0]) / 1e3, busy[i][3], busy[i + 1][2]
        lines.append(f"   {gaps[i] / 1e3:8.2f} ms idle at {at_ms:9.2f} ms, after {before[:60]}, before {after[:60]}")
        lines.append(f"      host meanwhile: {_host_ops_within(host_ops, start, end)}")
    return "\n".join(lines)


def _host_ops_within(host_ops: list[tuple[float, float, str]], start: float, end: float, count: int = 6) -> str:
    """The host ops that took the most of the window [start, end] (µs), with their share of it."""
    first = bisect.bisect_left(host_ops, (start - 1e7,))  # no host op of a run lasts 10 s
    overlaps: dict[str, float] = {}
    for op_start, op_end, name in host_ops[first:]:
        if op_start > end:
            break
        overlap = min(op_end, end) - max(op_start, start)
        if overlap > 0:
            overlaps[name] = overlaps.get(name, 0.0) + overlap
    top = sorted(overlaps.items(), key=lambda item: item[1], reverse=True)[:count]
    return ", ".join(f"{name[:50]} {100 * t / (end - start):.0f}%" for name, t in top) or "nothing recorded"
