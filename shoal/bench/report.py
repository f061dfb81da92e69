"""Benchmark reports: percentile summaries, the run's environment, JSON files and text tables.

A report is a plain dict (JSON-ready); `print_lines` is the one place the benchmarks write to
stdout.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100) of sorted values, linearly interpolated between ranks."""
    if not sorted_values:
        return math.nan
    position = (len(sorted_values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean, p50, p90, p99 (and min, max) of `values` × `scale` (1e3 gives ms from s)."""
    ordered = sorted(v * scale for v in values)
    if not ordered:
        return {"mean": math.nan, **{f"p{q}": math.nan for q in PERCENTILES}, "min": math.nan, "max": math.nan}
    return {
        "mean": sum(ordered) / len(ordered),
        **{f"p{q}": percentile(ordered, q) for q in PERCENTILES},
        "min": ordered[0],
        "max": ordered[-1],
    }


def environment() -> dict[str, Any]:
    """When and where a benchmark ran."""
    import shoal

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "shoal_version": shoal.__version__,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "argv": sys.argv,
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
    return env


def write_json(path: str | Path | None, report: dict[str, Any]) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(strict_json(report), indent=2, allow_nan=False) + "\n")


def strict_json(value: Any) -> Any:
    """`value` with NaN (no data) as null and infinities as "inf"/"-inf", which strict JSON lacks."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: numbers right-aligned, text left-aligned."""
    cells = [[str(h) for h in header]] + [[_cell(v) for v in row] for row in rows]
    numeric = [[False] * len(header)] + [[isinstance(v, int | float) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for n, (row, is_number) in enumerate(zip(cells, numeric)):
        lines.append("  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, is_number)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def format_rate(value: float, unit: str) -> str:
    """1.23e12, "B/s" → "1.23 TB/s"."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def print_lines(*lines: str) -> None:
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
