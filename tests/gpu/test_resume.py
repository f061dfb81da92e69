"""The GPU suite's resume plugin (tests/gpu/resume.py), on the CPU: a call past its deadline
starts no more tests, the next call runs only the rest, and under pytest-xdist the controller
keeps the state of what its workers collected and ran."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]

# Four files of two tests each; test_b's second test fails, test_c's first skips.
FILES = {
    "test_a": "def test_one():\n    pass\n\ndef test_two():\n    pass\n",
    "test_b": "def test_one():\n    pass\n\ndef test_two():\n    assert False\n",
    "test_c": "import pytest\n\ndef test_one():\n    pytest.skip('needs two GPUs')\n\ndef test_two():\n    pass\n",
    # The deadline passes during test_d's first test: it moves the plugin's to now (a clock-set
    # deadline would depend on how long pytest and its workers take to start).
    "test_d": (
        "import time\n\ndef test_one(request):\n"
        "    request.config.pluginmanager.get_plugin('gpu-resume').deadline = time.time()\n\n"
        "def test_two():\n    pass\n"
    ),
}
# test_d first: its first test is the first to run.
PATHS = ("test_d.py", "test_a.py", "test_b.py", "test_c.py")


def run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, state: Path, deadline: float | None, *args: str
) -> dict:
    monkeypatch.setenv("SHOAL_GPU_STATE", str(state))
    monkeypatch.setenv("PYTHONPATH", str(ROOT), prepend=os.pathsep)
    if deadline is None:
        monkeypatch.delenv("SHOAL_GPU_DEADLINE", raising=False)
    else:
        monkeypatch.setenv("SHOAL_GPU_DEADLINE", str(deadline))
    pytester.runpytest_subprocess("-p", "tests.gpu.resume", "-p", "no:cacheprovider", "-o", "addopts=", *args)
    return json.loads(state.read_text())


@pytest.mark.parametrize("xdist", [False, True])
def test_a_call_past_its_deadline_leaves_the_rest_to_the_next(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, xdist: bool
) -> None:
    pytester.makepyfile(**FILES)
    state = pytester.path / "state.json"
    args = ("-n", "2", "--dist", "loadfile") if xdist else ()
    first = run(pytester, monkeypatch, state, time.time() + 3600, *args, *PATHS)
    assert len(first["collected"]) == 8
    assert "test_d.py::test_one" in first["results"]
    assert 0 < len(first["results"]) < 8
    second = run(pytester, monkeypatch, state, None, *args, *PATHS)
    results = second["results"]
    assert sorted(results) == sorted(second["collected"]) and len(results) == 8
    outcomes = {nodeid: r["outcome"] for nodeid, r in results.items()}
    assert outcomes["test_b.py::test_two"] == "failed" and outcomes["test_c.py::test_one"] == "skipped"
    assert results["test_c.py::test_one"]["reason"].endswith("needs two GPUs")
    assert sum(outcome == "passed" for outcome in outcomes.values()) == 6
    # Nothing ran twice: the first call's results are the second's.
    assert all(results[nodeid] == r for nodeid, r in first["results"].items())
