"""A TP=2 server whose Ray worker actor is killed (`ray.kill`) while 16 requests stream: every
stream completes, with exactly the greedy text of an undisturbed run and no error; one kill past
`--max-worker-restarts` shuts the engine down cleanly (its workers gone) and the server answers
503."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server_utils import ServerProcess, process_exists

NUM_STREAMS = 16
MAX_TOKENS = 192  # ~4 s a round here: every stream is still running when the worker is killed
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "paged",
    "attention",
    "stores",
    "keys",
    "and",
    "values",
]
PROMPTS = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 5)) for i in range(NUM_STREAMS)]


@dataclass
class Stream:
    """What one streaming completion received: its text pieces with their arrival times, and
    the finish reason or the error event that ended it."""

    pieces: list[tuple[float, str]] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict | None = None

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.pieces)


def stream_completion(url: str, model: str, prompt: str, started: threading.Semaphore) -> Stream:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    result = Stream()
    with httpx.Client(timeout=120) as http, http.stream("POST", url, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                result.error = event["error"]
                continue
            choice = event["choices"][0]
            if choice["text"]:
                result.pieces.append((time.monotonic(), choice["text"]))
                if len(result.pieces) == 3:
                    started.release()  # this stream is well under way
            result.finish_reason = choice.get("finish_reason") or result.finish_reason
    return result


def stream_all(server: ServerProcess, kill_rank: int | None = None) -> tuple[list[Stream], float | None]:
    """16 concurrent streams; once every one has its first pieces, kill the worker actor of
    `kill_rank`. Returns the streams and when the kill happened."""
    started = threading.Semaphore(0)
    url = f"{server.url}/v1/completions"
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = [pool.submit(stream_completion, url, server.model_name, p, started) for p in PROMPTS]
        killed_at = None
        if kill_rank is not None:
            for _ in range(NUM_STREAMS):
                assert started.acquire(timeout=60), "the streams did not start"
            kill_worker(kill_rank)
            killed_at = time.monotonic()
        return [f.result(timeout=180) for f in futures], killed_at


def worker_actor_names() -> dict[int, str]:
    """Rank -> name of the live shoal worker actors of the cluster (one engine runs)."""
    import ray

    names = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        match = re.fullmatch(r"shoal-worker-[0-9a-f]+-(\d+)-\d+", actor["name"])
        if match and actor["namespace"] == "shoal":
            names[int(match.group(1))] = actor["name"]
    return names


def kill_worker(rank: int) -> None:
    import ray

    ray.kill(ray.get_actor(worker_actor_names()[rank], namespace="shoal"))


@pytest.fixture
def tp2_server(ray_cluster: dict, tiny_model_path: str, tmp_path: Path) -> Iterator[ServerProcess]:
    args = [tiny_model_path, "--tensor-parallel-size", "2", "--max-worker-restarts", "1", "--device", "cpu"]
    server = ServerProcess(args, tmp_path / "server.log")
    yield server
    server.stop()


def test_worker_killed_mid_stream_is_restarted_then_past_the_limit_503(tp2_server: ServerProcess) -> None:
    server = tp2_server
    expected, _ = stream_all(server)
    assert all(s.error is None and s.finish_reason == "length" for s in expected)
    assert len({s.text for s in expected}) > 1  # the prompts lead to different texts

    # Rank 0 (the sampling rank, which hosts the group's rendezvous) dies mid-stream.
    streams, killed_at = stream_all(server, kill_rank=0)
    assert killed_at is not None
    for ours, theirs in zip(streams, expected):
        assert ours.error is None, ours.error
        assert ours.finish_reason == "length"
        assert ours.text == theirs.text  # nothing sent twice, nothing changed, nothing missing
        # Under way at the kill, and streaming on after it.
        assert ours.pieces[0][0] < killed_at < ours.pieces[-1][0]
    assert "restarting worker rank(s) [0]" in server.log()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.metric("shoal:kv_cache_usage_perc") == 0

    # One death more than --max-worker-restarts 1: the streams end with an error, the engine
    # core shuts its workers down and exits, and the server answers 503.
    pid = server.engine_core_pid
    assert pid is not None
    streams, _ = stream_all(server, kill_rank=1)
    assert all(s.error is not None and s.error["code"] == "engine_dead" for s in streams)
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    assert httpx.get(f"{server.url}/health").status_code == 503
    deadline = time.monotonic() + 30
    while (process_exists(pid) or worker_actor_names()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not process_exists(pid) and not worker_actor_names()
    assert "max_worker_restarts=1" in server.log()
    assert server.stop() == 0, server.log()
