"""A two-node Ray cluster on one machine (tests/ray_nodes.py: cluster/start_head.sh and
cluster/start_worker.sh, one CPU a node, so that two {"CPU": 1} bundles must spread), then shoal
with TP=2 connecting to it by address: one worker on each node, the same tokens as one process.

The cluster is this test's own (one CPU a node, unlike the folder's three-node cluster); the
session's shared cluster is left alone, and the driver runs in a subprocess because Ray allows
one cluster per process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from shoal import LLM, SamplingParams
from tests.ray_nodes import REPO, LocalCluster

pytestmark = pytest.mark.cluster  # make test-cluster

NUM_NEW_TOKENS = 8


@pytest.fixture
def two_node_cluster() -> Iterator[LocalCluster]:
    cluster = LocalCluster(num_nodes=2, cpus_per_node=1)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_tp2_spreads_over_two_nodes(two_node_cluster: LocalCluster, tiny_checkpoints: dict) -> None:
    path = str(tiny_checkpoints["llama"])
    expected_llm = LLM(path, multiprocess=False)
    prompt = expected_llm.get_tokenizer().encode("The quick brown fox")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    expected = expected_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    expected_llm.shutdown()

    driver = [sys.executable, str(REPO / "tests/cluster/multi_node_driver.py")]
    run = subprocess.run(
        [*driver, two_node_cluster.address, path, json.dumps(prompt), str(NUM_NEW_TOKENS)],
        env=two_node_cluster.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode != 0 or not lines:
        pytest.fail(f"driver failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{two_node_cluster.logs()}")
    result = json.loads(lines[-1].removeprefix("RESULT "))

    assert len(result["cluster_nodes"]) == 2
    worker_nodes = result["worker_nodes"]
    assert len(worker_nodes) == 2 and set(worker_nodes) == set(result["cluster_nodes"])  # one worker per node
    assert worker_nodes[0] == result["driver_node"]  # rank 0 on the driver's node
    assert result["token_ids"] == expected
