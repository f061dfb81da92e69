"""Print the GPU suite's state (tests/gpu/resume.py) as one line per test file and a total.

    python3 tests/gpu/summary.py STATE.json

Exits 0 when every collected test has run and none failed or erred; 1 when one failed; 2 when
some are still to run (the next device call runs them).
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path

from tests.gpu.resume import load_state

OUTCOMES = ("passed", "failed", "error", "skipped")


def summarize(state: dict) -> tuple[list[str], int]:
    by_file: dict[str, Counter] = defaultdict(Counter)
    seconds: dict[str, float] = defaultdict(float)
    for nodeid in state["collected"]:
        path = nodeid.split("::")[0]
        result = state["results"].get(nodeid)
        by_file[path][result["outcome"] if result else "to run"] += 1
        seconds[path] += result["duration_s"] if result else 0.0
    total: Counter = Counter()
    lines = []
    for path in sorted(by_file):
        counts = by_file[path]
        total += counts
        lines.append(f"{path:<58} {_counts(counts)}  {seconds[path]:7.1f} s")
    lines.append(f"{'total':<58} {_counts(total)}  {sum(seconds.values()):7.1f} s")
    for nodeid, result in state["results"].items():
        if result["outcome"] in ("failed", "error"):
            lines.append(f"{result['outcome'].upper()} {nodeid}")
        elif result["outcome"] == "skipped":
            lines.append(f"skipped {nodeid}: {result['reason']}")
    status = 2 if total["to run"] else (1 if total["failed"] or total["error"] else 0)
    return lines, status


def _counts(counts: Counter) -> str:
    parts = [f"{counts[o]:3d} {o}" for o in OUTCOMES]
    if counts["to run"]:
        parts.append(f"{counts['to run']:3d} to run")
    return "  ".join(parts)


if __name__ == "__main__":
    lines, status = summarize(load_state(Path(sys.argv[1])))
    print("\n".join(lines))
    sys.exit(status)
