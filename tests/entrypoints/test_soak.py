"""Soak: 64 concurrent streams against the shared demo-model server for `SHOAL_SOAK_SECONDS`
(30 s in `make test`, after a warm-up round that touches the KV cache's pages; the `soak`
variant, `pytest -m soak`, runs `SHOAL_SOAK_LONG_SECONDS`, 600 by default): random client
cancellations mid-stream, mixed lengths, n > 1, unicode stop strings and a shared prompt prefix.
Zero errors, zero KV blocks in use at the end, and the RSS of the frontend and the engine-core
process flat within 10% over the run (see `soak`)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
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


async def _sample_rss(pids: dict[str, int], every_s: float, samples: dict[str, list[int]]) -> None:
    while True:
        await asyncio.sleep(every_s)
        for name, pid in pids.items():
            samples[name].append(rss_bytes(pid))


async def _soak_sampled(url: str, duration_s: float, pids: dict[str, int]) -> tuple[list[str], dict[str, list[int]]]:
    samples: dict[str, list[int]] = {name: [] for name in pids}
    sampler = asyncio.ensure_future(_sample_rss(pids, duration_s / 10, samples))
    try:
        return await _soak(url, duration_s, seed=1), samples
    finally:
        sampler.cancel()


def soak(server: ServerProcess, duration_s: float) -> None:
    """The RSS is sampled ten times over the run; flat means the median of the last third within
    10% of the peak of the first third: a leak grows with the requests served and lifts the
    whole last third, where one late spike of the allocator does not (a loaded 2-core machine
    measured peaks of 1239 then 1368 MiB, a median of 1295 in the last third). (The first
    sample after warm-up is no baseline, as the engine's allocator reaches its working set only
    some seconds into full load: measured, 1165 MiB at the warm-up's end, 1248 to 1372 MiB over
    the next 120 s, without a trend.)"""
    assert server.engine_core_pid is not None
    pids = {"frontend": server.process.pid, "engine core": server.engine_core_pid}
    warm_up_errors = asyncio.run(_soak(server.url, min(5.0, duration_s / 2), seed=0))
    errors, samples = asyncio.run(_soak_sampled(server.url, duration_s, pids))
    assert not warm_up_errors + errors, (warm_up_errors + errors)[:5]
    server.wait_for_metric(USED_BLOCKS, 0, timeout_s=30)
    for name, values in samples.items():
        print(f"{name} RSS every {duration_s / 10:g} s (MiB): {[round(v / 2**20) for v in values]}")
        third = max(1, len(values) // 3)
        first, last = max(values[:third]), statistics.median(values[-third:])
        assert last / first - 1 < 0.10, (name, first, last)


def test_soak(server: ServerProcess) -> None:
    soak(server, float(os.environ.get("SHOAL_SOAK_SECONDS", "30")))


LONG_SOAK_S = float(os.environ.get("SHOAL_SOAK_LONG_SECONDS", "600"))


@pytest.mark.soak
@pytest.mark.timeout(LONG_SOAK_S + 300)  # the warm-up, the drain and the server's start beside it
def test_soak_long(server: ServerProcess) -> None:
    soak(server, LONG_SOAK_S)
