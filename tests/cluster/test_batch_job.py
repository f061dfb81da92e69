"""`shoal batch` with TP=2 submitted as a Ray job through cluster/submit.sh onto the three-node
cluster: the two workers on two nodes (STRICT_SPREAD, seen by `shoal cluster status` while the
job runs); the job stopped midway and submitted again finishes the file, and every one of 200
result lines is there exactly once and equal to a one-process run's (greedy)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from shoal.cli import main as shoal_main
from tests.ray_nodes import REPO, LocalCluster

pytestmark = pytest.mark.cluster  # make test-cluster

NUM_LINES = 200
MAX_TOKENS = 3
# Few sequences at a time, so that the results arrive over many steps and a stop lands midway.
MAX_NUM_SEQS = "4"


def _write_requests(path: Path, model: str) -> None:
    lines = []
    for i in range(NUM_LINES):
        body = {"model": model, "prompt": f"Line {i} of the batch says", "max_tokens": MAX_TOKENS, "temperature": 0.0}
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    path.write_text("\n".join(lines) + "\n")


def _texts(path: Path) -> dict[str, str]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    texts = {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in lines}
    assert len(texts) == len(lines), "a line was answered twice"
    return texts


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _job_api(cluster: LocalCluster, job_id: str, action: str = "") -> dict:
    """Ray's job REST API on the head's dashboard (what `ray job status/stop/logs` call, without
    starting a process per call)."""
    url = f"{cluster.dashboard}/api/jobs/{job_id}{action}"
    request = urllib.request.Request(url, method="POST" if action == "/stop" else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)
    except (OSError, ValueError):
        return {}


def _job_status(cluster: LocalCluster, job_id: str) -> str:
    return _job_api(cluster, job_id).get("status", "?")


def _job_logs(cluster: LocalCluster, job_id: str) -> str:
    return _job_api(cluster, job_id, "/logs").get("logs", "")


def _stop_job(cluster: LocalCluster, job_id: str, timeout_s: float = 60) -> str:
    """Stop the job and wait until it has ended; returns its final status."""
    _job_api(cluster, job_id, "/stop")
    deadline = time.monotonic() + timeout_s
    while (status := _job_status(cluster, job_id)) in ("PENDING", "RUNNING", "?"):
        assert time.monotonic() < deadline, f"job {job_id} did not stop"
        time.sleep(0.2)
    return status


def engines(cluster: LocalCluster) -> list[dict]:
    """The shoal engines `shoal cluster status` sees on the cluster (none if it cannot say)."""
    argv = [sys.executable, "-m", "shoal", "cluster", "status", "--json", "--address", cluster.address]
    run = subprocess.run(argv, env=cluster.env, capture_output=True, text=True, timeout=120)
    return [e for e in json.loads(run.stdout)["engines"] if e["engine_id"]] if run.returncode == 0 else []


def submit(cluster: LocalCluster, job_id: str, command: str, *flags: str) -> None:
    """`cluster/submit.sh` of `shoal <command> <flags>`, not waiting for the job to end."""
    env = {
        **cluster.env,
        "RAY_DASHBOARD_PORT": str(cluster.dashboard_port),
        "PYTHON": sys.executable,
        "SUBMIT_FLAGS": f"--no-wait --submission-id {job_id}",
    }
    argv = [str(REPO / "cluster/submit.sh"), cluster.ip, command, *flags]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_batch_job_tp2_over_two_nodes_stopped_and_resubmitted(
    three_nodes: LocalCluster, tiny_checkpoints: dict, tmp_path: Path
) -> None:
    model = str(tiny_checkpoints["llama"])
    requests = tmp_path / "requests.jsonl"
    _write_requests(requests, model)
    expected = tmp_path / "expected.jsonl"
    argv = ["batch", "-i", str(requests), "-o", str(expected), "--model", model, "--disable-progress-bar"]
    assert shoal_main([*argv, "--max-num-seqs", MAX_NUM_SEQS]) == 0

    output = tmp_path / "results.jsonl"
    flags = ["-i", str(requests), "-o", str(output), "--model", model, "-tp", "2", "--max-num-seqs", MAX_NUM_SEQS]
    flags += ["--placement-strategy", "STRICT_SPREAD", "--disable-progress-bar"]

    # The first job, stopped once a tenth of the lines are written.
    submit(three_nodes, "shoal-batch-tp2-a", "batch", *flags)
    deadline = time.monotonic() + 300
    while _lines(output) < NUM_LINES // 10:
        assert time.monotonic() < deadline, _job_logs(three_nodes, "shoal-batch-tp2-a")[-3000:]
        assert _job_status(three_nodes, "shoal-batch-tp2-a") in ("PENDING", "RUNNING", "?")
        time.sleep(0.1)
    assert _stop_job(three_nodes, "shoal-batch-tp2-a") == "STOPPED"
    written = _lines(output)
    assert written < NUM_LINES, "the job finished before it could be stopped"

    # The second job, on the same output, answers only what the first left.
    submit(three_nodes, "shoal-batch-tp2-b", "batch", *flags)
    worker_nodes: list[str] = []
    deadline = time.monotonic() + 300
    while (status := _job_status(three_nodes, "shoal-batch-tp2-b")) in ("PENDING", "RUNNING", "?"):
        assert time.monotonic() < deadline, "the job did not finish"
        if len(worker_nodes) < 2:
            worker_nodes = [w.get("node_id", "") for e in engines(three_nodes) for w in e["workers"]]
        time.sleep(1)
    logs = _job_logs(three_nodes, "shoal-batch-tp2-b")
    assert status == "SUCCEEDED", logs[-3000:]
    assert len(worker_nodes) == 2 and len(set(worker_nodes)) == 2  # TP=2, one worker on each of two nodes
    assert _texts(output) == _texts(expected)  # every line once (see _texts), as one process answers it
