"""The device timeline summaries of shoal.workers.profiler, on a stand-in for torch.profiler's
events (a CPU run records no device events)."""

from __future__ import annotations

from types import SimpleNamespace

from shoal.workers.profiler import device_busy_s, device_idle_report


def _profile(*intervals_us: tuple[float, float], cpu: tuple[float, float] = (0.0, 1e6)):
    def event(kind: str, name: str, start: float, end: float):
        return SimpleNamespace(
            device_type=SimpleNamespace(name=kind), name=name, time_range=SimpleNamespace(start=start, end=end)
        )

    events = [event("CUDA", f"k{i}", *span) for i, span in enumerate(intervals_us)] + [event("CPU", "step", *cpu)]
    return SimpleNamespace(events=lambda: events)


def test_busy_time_counts_overlapping_kernels_once() -> None:
    profile = _profile((0, 100), (50, 150), (150, 160), (1000, 1010))
    assert device_busy_s(profile) == (160 + 10) / 1e6  # the CPU event is not device time


def test_idle_report_sorts_the_gaps_by_length() -> None:
    # gaps: 5 us (launch), 40 us and 60 us (host waits), 2,000 us (a stall)
    profile = _profile((0, 10), (15, 20), (60, 70), (130, 140), (2140, 2150))
    report = device_idle_report(profile)
    assert "0-10 us: 1 gaps, 0.0 ms" in report
    assert "10-100 us: 2 gaps, 0.1 ms" in report
    assert "100-1000 us: 0 gaps, 0.0 ms" in report
    assert ">= 1000 us: 1 gaps, 2.0 ms" in report
    longest, host = report.splitlines()[1::2], report.splitlines()[2::2]
    assert len(longest) == 4
    assert longest[0].split() == ["2.00", "ms", "idle", "at", "0.14", "ms,", "after", "k3,", "before", "k4"]
    assert longest[1].split()[:2] == ["0.06", "ms"]
    assert host[0].split() == ["host", "meanwhile:", "step", "100%"]  # the host op spanning the gap
