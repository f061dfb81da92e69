"""One three-node Ray cluster on this machine (tests/ray_nodes.py) for every test of this folder,
torn down at the end of the session, also when a test fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ray_nodes import LocalCluster


@pytest.fixture(scope="session")
def three_nodes() -> Iterator[LocalCluster]:
    cluster = LocalCluster(num_nodes=3, cpus_per_node=2)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
