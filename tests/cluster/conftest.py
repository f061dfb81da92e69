"""One three-node Ray cluster on this machine (tests/ray_nodes.py) for every test of this folder,
stopped after the folder's last test (its dozen Ray processes would otherwise take CPU from
every later test; a "package" fixture would not do it, this folder being no package), and at
the end of the session in any case, also when a test fails."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ray_nodes import LocalCluster

_HERE = Path(__file__).parent
_running: list[LocalCluster] = []


@pytest.fixture(scope="session")
def three_nodes() -> Iterator[LocalCluster]:
    cluster = LocalCluster(num_nodes=3, cpus_per_node=2)
    _running.append(cluster)
    try:
        cluster.start()
        yield cluster
    finally:
        _stop_all()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or _HERE not in Path(nextitem.path).parents:
        _stop_all()


def _stop_all() -> None:
    while _running:
        _running.pop().stop()
