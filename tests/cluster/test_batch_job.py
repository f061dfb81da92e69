"""`shoal batch` with TP=2 submitted as a Ray job through cluster/submit.sh onto the three-node
cluster: the two workers on two nodes (STRICT_SPREAD, seen by `shoal cluster status` while the
job runs) and every one of 200 result lines equal to a one-process run's (greedy)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from shoal.cli import main as shoal_main
from tests.ray_nodes import RAY, REPO, LocalCluster

NUM_LINES = 200
MAX_TOKENS = 3


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


def _job_status(cluster: LocalCluster, job_id: str) -> str:
    argv = [RAY, "job", "status", "--address", cluster.dashboard, job_id]
    out = subprocess.run(argv, env=cluster.env, capture_output=True, text=True, timeout=60).stdout.lower()
    return next((s.upper() for s in ("succeeded", "failed", "stopped", "running", "pending") if s in out), "?")


def _engine_worker_nodes(cluster: LocalCluster) -> list[str]:
    argv = [sys.executable, "-m", "shoal", "cluster", "status", "--json", "--address", cluster.address]
    run = subprocess.run(argv, env=cluster.env, capture_output=True, text=True, timeout=120)
    engines = [e for e in json.loads(run.stdout)["engines"] if e["engine_id"]] if run.returncode == 0 else []
    return [w.get("node_id", "") for e in engines for w in e["workers"]]


def test_batch_job_tp2_over_two_nodes_matches_one_process(
    three_nodes: LocalCluster, tiny_checkpoints: dict, tmp_path: Path
) -> None:
    model = str(tiny_checkpoints["llama"])
    requests = tmp_path / "requests.jsonl"
    _write_requests(requests, model)
    expected = tmp_path / "expected.jsonl"
    argv = ["batch", "-i", str(requests), "-o", str(expected), "--model", model, "--disable-progress-bar"]
    assert shoal_main(argv) == 0

    output = tmp_path / "results.jsonl"
    env = {
        **three_nodes.env,
        "RAY_DASHBOARD_PORT": str(three_nodes.dashboard_port),
        "PYTHON": sys.executable,
        "SUBMIT_FLAGS": "--no-wait --submission-id shoal-batch-tp2",
    }
    flags = ["-i", str(requests), "-o", str(output), "--model", model, "-tp", "2"]
    flags += ["--placement-strategy", "STRICT_SPREAD", "--disable-progress-bar"]
    submit = subprocess.run(
        [str(REPO / "cluster/submit.sh"), three_nodes.ip, "batch", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submit.returncode == 0, submit.stderr

    worker_nodes: list[str] = []
    deadline = time.monotonic() + 300
    while (status := _job_status(three_nodes, "shoal-batch-tp2")) in ("PENDING", "RUNNING", "?"):
        assert time.monotonic() < deadline, "the job did not finish"
        if len(worker_nodes) < 2:
            worker_nodes = _engine_worker_nodes(three_nodes)
        time.sleep(1)
    logs = subprocess.run(
        [RAY, "job", "logs", "--address", three_nodes.dashboard, "shoal-batch-tp2"],
        env=three_nodes.env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert status == "SUCCEEDED", logs[-3000:]
    assert len(worker_nodes) == 2 and len(set(worker_nodes)) == 2  # TP=2, one worker on each of two nodes
    assert _texts(output) == _texts(expected)
