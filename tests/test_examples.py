"""`make demo`'s script prints real completions of the demo model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_offline_inference_example_prints_completions(demo_model_path: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "offline_inference.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if "->" in line]
    assert len(lines) == 5  # four prompts and the chat reply
    assert "Paris" in lines[0] and "Paris" in lines[-1]
