"""tests/gpu/profile_steps.py on CPU with a tiny model, so the GPU machine's profiling tool does
not break unnoticed: the timing-only A/B path (with a decode-tuning override) and the profiled
path with its idle-gap report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("profile_steps.py")
ROOT = SCRIPT.parents[2]
SMALL = ["--num-prompts", "4", "--input-len", "12", "--output-len", "4", "--engine-arg", "max_model_len=128"]


def _run(model: Path, out: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(model), "--out", str(out), *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out.read_text()


def test_timing_only_reports_both_full_runs(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    report = _run(
        tiny_checkpoints["llama"], tmp_path / "ab.txt", "--timing-only", "--decode-tuning", "heads_fastest=False"
    )
    assert "decode tuning ['heads_fastest=False']" in report
    assert "first full run" in report
    assert report.splitlines()[-1].startswith("wall without profilers") and "output tokens/s" in report


def test_profiled_run_reports_the_host_and_the_wall(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    report = _run(tiny_checkpoints["llama"], tmp_path / "profile.txt")
    assert "steps" in report and "engine's own time" in report
    assert "device idle between kernels by gap length" in report  # no kernels on CPU: every bucket empty
    assert "wall under cProfile" in report and "wall without profilers" in report
