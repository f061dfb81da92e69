"""A two-node Ray cluster on one machine, brought up with cluster/start_head.sh and
cluster/start_worker.sh (separate `ray start` processes, one CPU each, so that two {"CPU": 1}
bundles must spread), then shoal with TP=2 connecting to it by address: one worker on each node,
the same tokens as one process.

The cluster is this test's own (its own temp dir and ports; one CPU a node, unlike the folder's
three-node cluster), torn down at the end by stopping the two `ray start --block` processes this
test started; the session's shared cluster is left alone, and the driver runs in a subprocess because Ray allows one cluster per process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal import LLM, SamplingParams
from tests.ray_nodes import REPO, free_ports, node_port_flags

pytestmark = pytest.mark.cluster  # make test-cluster

NUM_NEW_TOKENS = 8


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to `ray start --block` stops the Ray processes it started on its node."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its own session, started by this test
        process.wait()


@pytest.fixture
def two_node_cluster() -> Iterator[tuple[str, dict[str, str], Path]]:
    """(address, environment for drivers, folder of the nodes' logs) of a fresh two-node cluster."""
    temp_dir = tempfile.mkdtemp(prefix="shoal-ray-")  # short: Ray's socket paths must fit 107 bytes
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(
        RAY_AUTH_MODE="disabled",
        RAY=str(Path(sys.executable).with_name("ray")),
        RAY_PORT=str(port),
        SHOAL_LOGGING_LEVEL="WARNING",
    )
    common = ["--block", "--num-cpus=1", "--include-dashboard=false", *node_port_flags()]
    processes = []
    try:
        with open(Path(temp_dir) / "head.log", "w") as log:
            head = [str(REPO / "cluster/start_head.sh"), f"--temp-dir={temp_dir}", *common]
            processes.append(subprocess.Popen(head, env=env, stdout=log, stderr=log, start_new_session=True))
        address = f"{_node_ip()}:{port}"
        common = ["--block", "--num-cpus=1", '--resources={"node2": 1}', *node_port_flags()]
        with open(Path(temp_dir) / "worker.log", "w") as log:
            worker = [str(REPO / "cluster/start_worker.sh"), address, f"--temp-dir={temp_dir}", *common]
            processes.append(subprocess.Popen(worker, env=env, stdout=log, stderr=log, start_new_session=True))
        yield address, env, Path(temp_dir)
    finally:
        for process in reversed(processes):
            _stop(process)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def test_tp2_spreads_over_two_nodes(two_node_cluster: tuple[str, dict[str, str], Path], tiny_checkpoints: dict) -> None:
    address, env, log_dir = two_node_cluster
    path = str(tiny_checkpoints["llama"])
    expected_llm = LLM(path, multiprocess=False)
    prompt = expected_llm.get_tokenizer().encode("The quick brown fox")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    expected = expected_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    expected_llm.shutdown()

    driver = [sys.executable, str(REPO / "tests/cluster/multi_node_driver.py")]
    run = subprocess.run(
        [*driver, address, path, json.dumps(prompt), str(NUM_NEW_TOKENS)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode != 0 or not lines:
        node_logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(log_dir.glob("*.log")))
        pytest.fail(f"driver failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{node_logs}")
    result = json.loads(lines[-1].removeprefix("RESULT "))

    assert len(result["cluster_nodes"]) == 2
    worker_nodes = result["worker_nodes"]
    assert len(worker_nodes) == 2 and set(worker_nodes) == set(result["cluster_nodes"])  # one worker per node
    assert worker_nodes[0] == result["driver_node"]  # rank 0 on the driver's node
    assert result["token_ids"] == expected
