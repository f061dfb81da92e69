"""Serving on the three-node cluster: `shoal serve -tp 2` submitted as a Ray job, and a
two-replica Ray Serve deployment (`shoal serve --num-replicas 2`) that loses one replica's
engine, keeps answering through the other and gets the replica back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from tests.cluster.test_batch_job import _job_logs, _job_status, _stop_job, engines, submit
from tests.ray_nodes import LocalCluster, free_ports

pytestmark = pytest.mark.cluster  # make test-cluster

SMALL_ENGINE = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(64 * 1024**2)]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _wait_for_health(url: str, timeout_s: float, still_running: Callable[[], None]) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healthy(url):
        assert time.monotonic() < deadline, f"{url} did not become healthy in {timeout_s} s"
        still_running()
        time.sleep(1)


def _answers(url: str, model: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0.0
    )
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
    return chat.choices[0].message.content or ""


def test_serve_tp2_as_a_ray_job(three_nodes: LocalCluster, tiny_checkpoints: dict) -> None:
    (port,) = free_ports(1)
    url = f"http://{three_nodes.ip}:{port}"
    # The tiny Llama: the demo model's 9 heads do not split over two ranks.
    flags = [str(tiny_checkpoints["llama"]), "-tp", "2", "--host", three_nodes.ip, "--port", str(port), *SMALL_ENGINE]
    submit(three_nodes, "shoal-serve-tp2", "serve", *flags)

    def still_running() -> None:
        status = _job_status(three_nodes, "shoal-serve-tp2")
        assert status in ("PENDING", "RUNNING", "?"), _job_logs(three_nodes, "shoal-serve-tp2")[-3000:]

    try:
        _wait_for_health(url, 300, still_running)
        model = openai.OpenAI(base_url=f"{url}/v1", api_key="unused").models.list().data[0].id
        assert _answers(url, model)
        assert [len(e["workers"]) for e in engines(three_nodes)] == [2]
    finally:
        status = _stop_job(three_nodes, "shoal-serve-tp2")
    assert status == "STOPPED"
    deadline = time.monotonic() + 60
    while engines(three_nodes):  # the stopped job's engine, workers and placement group go with it
        assert time.monotonic() < deadline, engines(three_nodes)
        time.sleep(1)


def _replicas(cluster: LocalCluster) -> list[dict]:
    """The running replicas of the `shoal` application, as Serve's REST API lists them."""
    try:
        with urllib.request.urlopen(f"{cluster.dashboard}/api/serve/applications/", timeout=10) as response:
            applications = json.load(response)["applications"]
    except (OSError, ValueError, KeyError):
        return []
    deployment = applications.get("shoal", {}).get("deployments", {}).get("shoal", {})
    return [r for r in deployment.get("replicas", []) if r["state"] == "RUNNING"]


@pytest.fixture
def two_replicas(three_nodes: LocalCluster, demo_model_path: str, tmp_path: Path):
    (port,) = free_ports(1)
    url = f"http://{three_nodes.ip}:{port}"
    argv = [sys.executable, "-m", "shoal", "serve", demo_model_path, "--num-replicas", "2"]
    argv += ["--host", three_nodes.ip, "--port", str(port), *SMALL_ENGINE]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        driver = subprocess.Popen(argv, env=three_nodes.driver_env(), stdout=out, stderr=subprocess.STDOUT)

    def driver_alive() -> None:
        assert driver.poll() is None, log.read_text()[-3000:]

    try:
        deadline = time.monotonic() + 300
        while len(_replicas(three_nodes)) < 2 or not _healthy(url):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            driver_alive()
            time.sleep(1)
        yield url
    finally:
        driver.send_signal(signal.SIGINT)  # shoal deletes the Serve application on the way out
        try:
            driver.wait(timeout=60)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()


def test_two_replicas_survive_the_loss_of_one(three_nodes: LocalCluster, two_replicas: str) -> None:
    url = two_replicas
    model = openai.OpenAI(base_url=f"{url}/v1", api_key="unused").models.list().data[0].id
    before = _answers(url, model)
    replicas = _replicas(three_nodes)
    assert len(replicas) == 2

    os.kill(replicas[0]["pid"], signal.SIGKILL)  # the replica's process holds its engine core
    answered = [_answers(url, model) for _ in range(6)]
    assert answered == [before] * 6  # through the other replica, greedy and the same

    deadline = time.monotonic() + 300
    killed = replicas[0]["replica_id"]
    while not ((now := _replicas(three_nodes)) and len(now) == 2 and killed not in {r["replica_id"] for r in now}):
        assert time.monotonic() < deadline, f"Serve did not bring the replica back: {now}"
        time.sleep(1)
    assert [_answers(url, model) for _ in range(4)] == [before] * 4
