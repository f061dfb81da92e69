"""A pytest plugin that lets the GPU suite run across device calls of limited length.

One device call may run for at most ten minutes, and the whole suite (with the CUDA build) takes
longer. With `-p tests.gpu.resume`, every finished test's outcome is written to a JSON state file
(`SHOAL_GPU_STATE`) as soon as it is known; tests already in the file are deselected, so the
next call, given the state back, runs only the rest. No new test starts after the epoch time in
`SHOAL_GPU_DEADLINE`: the call ends between tests rather than being killed inside one. A test cut
off by a hard timeout is not in the state and runs again next time.

Under pytest-xdist the controller keeps the state: it learns what the workers collected
(`pytest_xdist_node_collection_finished`) and records the reports they send; the workers only
read the state, to deselect what is done, and start no test after the deadline.

`tests/gpu/summary.py` prints the state as one line per test file and a total.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

STATE_ENV = "SHOAL_GPU_STATE"
DEADLINE_ENV = "SHOAL_GPU_DEADLINE"


def load_state(path: Path) -> dict:
    """{"collected": [nodeid, ...], "results": {nodeid: {"outcome", "duration_s", "reason"}}}"""
    if path.exists():
        return json.loads(path.read_text())
    return {"collected": [], "results": {}}


class Resume:
    def __init__(self, state_path: Path, deadline: float | None, is_worker: bool) -> None:
        self.state_path = state_path
        self.deadline = deadline
        self.is_worker = is_worker  # an xdist worker: it reads the state, the controller writes it
        self.state = load_state(state_path)
        self._current: dict[str, dict] = {}  # nodeid -> its outcome so far, phase by phase

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        self._add_collected([item.nodeid for item in items])
        done = self.state["results"]
        deselected = [item for item in items if item.nodeid in done]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item.nodeid not in done]
        self._save()

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        """The controller: what a worker collected (less what the state says is done)."""
        self._add_collected(ids)
        self._save()

    def _add_collected(self, nodeids: list[str]) -> None:
        known = set(self.state["collected"])
        self.state["collected"] += [nodeid for nodeid in nodeids if nodeid not in known]

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        """Past the deadline a test is not started: the run loop passes over the rest (an xdist
        worker's queue too), and the next call picks up from there."""
        return True if self._past_deadline() else None

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """A test's outcome: an error in setup or teardown, a failure in its call, a skip (with
        its reason), or a pass; recorded once its teardown is over."""
        result = self._current.setdefault(report.nodeid, {"outcome": "passed", "duration_s": 0.0, "reason": ""})
        result["duration_s"] = round(result["duration_s"] + report.duration, 3)
        if report.failed:
            result["outcome"] = "failed" if report.when == "call" else "error"
        elif report.skipped and result["outcome"] == "passed":
            result["outcome"] = "skipped"
            longrepr = report.longrepr
            result["reason"] = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        if report.when == "teardown":
            self.state["results"][report.nodeid] = self._current.pop(report.nodeid)
            self._save()

    def _save(self) -> None:
        if self.is_worker:
            return
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.state_path)


def pytest_configure(config: pytest.Config) -> None:
    state_path = os.environ.get(STATE_ENV)
    if not state_path:
        raise pytest.UsageError(f"-p tests.gpu.resume needs {STATE_ENV} (the JSON state file)")
    deadline = os.environ.get(DEADLINE_ENV)
    is_worker = hasattr(config, "workerinput")
    resume = Resume(Path(state_path), float(deadline) if deadline else None, is_worker)
    config.pluginmanager.register(resume, "gpu-resume")
