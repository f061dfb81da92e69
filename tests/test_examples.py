"""`make demo`'s script and the README's offline snippet print real completions of the demo model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def readme_offline_snippet() -> tuple[str, list[str]]:
    """The README's "Offline generation" code and the lines it says that code prints."""
    section = (ROOT / "README.md").read_text().split("## Offline generation", 1)[1]
    match = re.search(r"```python\n(.*?)```\n\nprints[^\n]*\n\n((?:    [^\n]*\n)+)", section, re.DOTALL)
    assert match, "the README's offline snippet and its printed lines"
    return match.group(1), [line[4:] for line in match.group(2).splitlines()]


def test_readme_offline_snippet_prints_what_the_readme_says(demo_model_path: str, tmp_path: Path) -> None:
    code, expected = readme_offline_snippet()
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == expected


def run_example(name: str, model: str) -> list[str]:
    """The example's lines that report a generation (its own shoal: the repository's)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "examples" / name), model]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return [line for line in result.stdout.splitlines() if line.startswith("weights ")]


@pytest.mark.slow  # ~25 s (a new process joins Ray and starts a TP=2 engine); tests/rl covers its path
def test_rlhf_example_syncs_three_steps(ray_cluster: dict, tiny_checkpoints: dict) -> None:
    """On the session's Ray cluster (RAY_ADDRESS), with the tiny Llama."""
    lines = run_example("rlhf.py", str(tiny_checkpoints["llama"]))
    assert [line.split()[1] for line in lines] == ["step-1", "step-2", "step-3"]


def test_rlhf_colocate_example_sleeps_and_updates(tiny_checkpoints: dict) -> None:
    lines = run_example("rlhf_colocate.py", str(tiny_checkpoints["llama"]))
    assert [line.split()[1] for line in lines] == ["0:", "step-1:", "step-2:", "step-3:"]
