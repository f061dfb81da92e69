"""Cluster failures provoked for real on the three-node cluster, each ending within 30 s with a
message that says what is wrong: a placement no set of nodes can hold, and a cluster address
nobody answers at."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ray_nodes import LocalCluster, free_ports

pytestmark = pytest.mark.cluster  # make test-cluster

CLEAR_ERROR_S = 30.0


def _batch(env: dict[str, str], model: str, tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    requests = tmp_path / "in.jsonl"
    requests.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}\n')
    argv = [sys.executable, "-m", "shoal", "batch", "-i", str(requests), "-o", str(tmp_path / "out.jsonl")]
    start = time.monotonic()
    run = subprocess.run([*argv, "--model", model, *flags], env=env, capture_output=True, text=True, timeout=120)
    return run, time.monotonic() - start


def test_a_placement_no_nodes_can_hold_fails_at_once_naming_each_node(
    three_nodes: LocalCluster, tiny_checkpoints: dict, tmp_path: Path
) -> None:
    model = str(tiny_checkpoints["llama"])
    flags = ("-tp", "4", "--placement-strategy", "STRICT_SPREAD", "--disable-progress-bar")
    run, elapsed = _batch(three_nodes.driver_env(), model, tmp_path, *flags)
    assert run.returncode != 0
    assert "can never place 4 worker bundles {'CPU': 1.0} with placement strategy STRICT_SPREAD" in run.stderr
    assert "(it needs 4 nodes that hold one each)" in run.stderr
    node_lines = {line.strip() for line in run.stderr.splitlines() if line.strip().endswith(": 2 bundle(s)")}
    assert len(node_lines) == 3 and sum("(head)" in line for line in node_lines) == 1, node_lines  # each node
    assert elapsed < CLEAR_ERROR_S, elapsed
    assert not (tmp_path / "out.jsonl").exists() or (tmp_path / "out.jsonl").read_text() == ""


def test_a_dead_cluster_address_fails_at_once(
    three_nodes: LocalCluster, tiny_checkpoints: dict, tmp_path: Path
) -> None:
    (port,) = free_ports(1)
    env = three_nodes.driver_env(RAY_ADDRESS=f"127.0.0.1:{port}")
    run, elapsed = _batch(env, str(tiny_checkpoints["llama"]), tmp_path, "-tp", "2", "--disable-progress-bar")
    assert run.returncode != 0
    assert f"No Ray cluster answers at 127.0.0.1:{port} (RAY_ADDRESS)" in run.stderr
    assert elapsed < CLEAR_ERROR_S, elapsed
