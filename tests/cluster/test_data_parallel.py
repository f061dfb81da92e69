"""`shoal batch --data-parallel-size 2` on the three-node cluster (two Ray Data replicas, each its
own engine) answers every line as one engine does (greedy, matched by custom_id)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shoal.cli import main as shoal_main
from tests.cluster.test_batch_job import _texts, _write_requests
from tests.ray_nodes import LocalCluster

pytestmark = pytest.mark.cluster  # make test-cluster


def test_two_replicas_equal_one(three_nodes: LocalCluster, tiny_checkpoints: dict, tmp_path: Path) -> None:
    model = str(tiny_checkpoints["llama"])
    requests, expected, output = tmp_path / "in.jsonl", tmp_path / "one.jsonl", tmp_path / "dp2.jsonl"
    _write_requests(requests, model)
    base = ["batch", "-i", str(requests), "--model", model, "--disable-progress-bar"]
    assert shoal_main([*base, "-o", str(expected)]) == 0
    run = subprocess.run(
        [sys.executable, "-m", "shoal", *base, "-o", str(output), "--data-parallel-size", "2"],
        env=three_nodes.driver_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert _texts(output) == _texts(expected)
