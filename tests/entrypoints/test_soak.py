"""Soak: 64 concurrent streams against the shared demo-model server for `SHOAL_SOAK_SECONDS`
(15 s by default, after a warm-up round that touches the KV cache's pages; the `slow` variant
runs 300 s): random client cancellations mid-stream, mixed lengths, n > 1, unicode stop strings
and a shared prompt prefix. Zero errors, zero KV blocks in use at the end, and the RSS of the
frontend and the engine-core process flat within 10% from the warm-up's end to the end."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server_utils import ServerProcess

NUM_STREAMS = 64
PREFIX = "You are a helpful assistant. Answer briefly and kindly. " * 4
USED_BLOCKS = "shoal:num_used_kv_blocks"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def _one_stream(client: httpx.AsyncClient, rng: random.Random, errors: list[str]) -> None:
    body = {
        "prompt": PREFIX + rng.choice(["Hi", "Tell me a story", "Count to ten", "Ça va? 你好"]),
        "max_tokens": rng.choice([1, 4, 16, 32]),
        "n": rng.choice([1, 1, 2, 3]),
        "stop": rng.choice([None, ["\n\n"], ["é", "好"]]),
        "stream": True,
        "temperature": 0.8,
    }
    cancel_after = rng.choice([None, None, None, 1, 3])  # events read before the client leaves
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            errors.append(f"{response.status_code}: {(await response.aread())[:200]!r}")
            return
        num_events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                errors.append(str(chunk["error"]))
            num_events += 1
            if cancel_after is not None and num_events >= cancel_after:
                return  # the client leaves mid-stream: the server must abort the request


async def _soak(url: str, duration_s: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    errors: list[str] = []
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=NUM_STREAMS + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            while time.monotonic() < deadline:
                await _one_stream(client, rng, errors)

        await asyncio.gather(*(worker() for _ in range(NUM_STREAMS)))
    return errors


def soak(server: ServerProcess, duration_s: float) -> None:
    assert server.engine_core_pid is not None
    pids = {"frontend": server.process.pid, "engine core": server.engine_core_pid}
    warm_up_errors = asyncio.run(_soak(server.url, min(10.0, duration_s / 2), seed=0))
    start_rss = {name: rss_bytes(pid) for name, pid in pids.items()}
    errors = warm_up_errors + asyncio.run(_soak(server.url, duration_s, seed=1))
    end_rss = {name: rss_bytes(pid) for name, pid in pids.items()}
    assert not errors, errors[:5]
    server.wait_for_metric(USED_BLOCKS, 0, timeout_s=30)
    for name in pids:
        growth = end_rss[name] / start_rss[name] - 1
        print(f"{name}: RSS {start_rss[name] / 2**20:.0f} -> {end_rss[name] / 2**20:.0f} MiB ({growth:+.1%})")
        assert growth < 0.10, (name, start_rss[name], end_rss[name])


def test_soak(server: ServerProcess) -> None:
    soak(server, float(os.environ.get("SHOAL_SOAK_SECONDS", "15")))


@pytest.mark.slow
def test_soak_long(server: ServerProcess) -> None:
    soak(server, float(os.environ.get("SHOAL_SOAK_LONG_SECONDS", "300")))
