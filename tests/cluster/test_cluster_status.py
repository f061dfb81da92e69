"""`shoal cluster status` on the three-node cluster: every node with its CPUs and custom
resources, free amounts, and (with an engine running) the engine's workers and placement group."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.ray_nodes import LocalCluster

pytestmark = pytest.mark.cluster  # make test-cluster


def _status(cluster: LocalCluster, *flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "shoal", "cluster", "status", "--address", cluster.address, *flags]
    return subprocess.run(argv, env=cluster.env, capture_output=True, text=True, timeout=120)


def test_status_lists_the_nodes_and_their_resources(three_nodes: LocalCluster) -> None:
    result = _status(three_nodes, "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    nodes = status["nodes"]
    assert len(nodes) == 3 and sum(n["head"] for n in nodes) == 1
    assert all(n["resources"]["CPU"] == 2 for n in nodes)
    assert sorted(k for n in nodes for k in n["resources"] if k.startswith("node")) == ["node1", "node2"]
    assert all(0 <= n["free"].get("CPU", 0) <= 2 for n in nodes)

    text = _status(three_nodes)
    assert text.returncode == 0 and "3 node(s) alive" in text.stdout and "(head)" in text.stdout


def test_status_of_a_dead_address_says_so(three_nodes: LocalCluster) -> None:
    argv = [sys.executable, "-m", "shoal", "cluster", "status", "--address", "127.0.0.1:1"]
    result = subprocess.run(argv, env=three_nodes.env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "127.0.0.1:1" in result.stderr
