"""Engine lifecycle: an engine dropped by garbage collection, by `shutdown()` or by leaving its
`with` block stops its engine-core process, kills its Ray worker actors and removes its
placement group, so that the next engine of the same process starts at once.

Every engine joins the session's Ray cluster (`ray_cluster`); what is left is read through
Ray's state API, as an operator would see it.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from shoal import LLM, SamplingParams
from shoal.config import EngineArgs
from shoal.frontend.async_llm import AsyncLLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TP2: dict[str, Any] = dict(tensor_parallel_size=2, max_num_seqs=4, max_model_len=64)
# Ray's state API is eventually consistent: a killed actor is DEAD a moment later.
SETTLE_S = 10.0


def engine_footprint() -> tuple[set[str], set[str]]:
    """(ids of the live shoal worker actors, ids of the placement groups they are in)."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE"), ("ray_namespace", "=", "shoal")], detail=True)
    workers = [a for a in actors if (a.name or "").startswith("shoal-worker-")]
    return {a.actor_id for a in workers}, {a.placement_group_id for a in workers if a.placement_group_id}


def live_placement_groups() -> set[str]:
    from ray.util.state import list_placement_groups

    groups = list_placement_groups(detail=True)
    return {g.placement_group_id for g in groups if g.state in ("CREATED", "PENDING", "RESCHEDULING")}


def assert_released(actor_ids: set[str], group_ids: set[str], core_pid: int) -> None:
    """None of the engine's actors is alive, none of its groups exists, its process is gone."""
    assert not psutil.pid_exists(core_pid), "the engine-core process is still running"
    deadline = time.monotonic() + SETTLE_S
    while True:
        alive_actors = actor_ids & engine_footprint()[0]
        live_groups = group_ids & live_placement_groups()
        if not alive_actors and not live_groups:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: actors {alive_actors}, placement groups {live_groups}")
        time.sleep(0.2)


def check_engine(llm: LLM) -> tuple[set[str], set[str], int]:
    """Generate once; (the engine's actors, its placement groups, its engine-core pid)."""
    outputs = llm.generate(["The quick brown fox"], GREEDY, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == GREEDY.max_tokens
    actors, groups = engine_footprint()
    assert len(actors) == 2 and len(groups) == 1
    pid = llm.engine_core.engine_core_pid
    assert pid is not None and psutil.pid_exists(pid)
    return actors, groups, pid


def drop_by_del(path: str) -> tuple[set[str], set[str], int]:
    llm = LLM(path, **TP2)
    footprint = check_engine(llm)
    del llm
    gc.collect()
    return footprint


def drop_by_shutdown(path: str) -> tuple[set[str], set[str], int]:
    llm = LLM(path, **TP2)
    footprint = check_engine(llm)
    llm.shutdown()
    llm.shutdown()  # idempotent
    return footprint


def drop_by_with(path: str) -> tuple[set[str], set[str], int]:
    with LLM(path, **TP2) as llm:
        footprint = check_engine(llm)
    return footprint


@pytest.mark.timeout(300)
def test_tp2_engine_dropped_three_ways_leaves_nothing(ray_cluster: dict, tiny_checkpoints: dict) -> None:
    path = str(tiny_checkpoints["llama"])
    ways: list[Callable[[str], tuple[set[str], set[str], int]]] = [drop_by_del, drop_by_shutdown, drop_by_with]
    for drop in ways:
        actors, groups, pid = drop(path)
        assert_released(actors, groups, pid)


@pytest.mark.timeout(120)
def test_async_llm_released_by_async_with(tiny_checkpoints: dict) -> None:
    args = EngineArgs(model=str(tiny_checkpoints["llama"]), max_num_seqs=4, max_model_len=64)

    async def main() -> int:
        async with AsyncLLM(args) as engine:
            outputs = [o async for o in engine.generate("Hello world", GREEDY, "r0")]
            assert sum(len(o.outputs[0].token_ids) for o in outputs) == GREEDY.max_tokens
            pid = engine.engine_core_pid
        return pid

    assert not psutil.pid_exists(asyncio.run(main()))


def test_dropped_async_client_with_its_reader_thread_stops_its_process() -> None:
    """The asyncio client's reader thread holds the client only weakly: dropped (here before
    it had a config, which is what AsyncLLM's garbage collection comes down to), the client's
    finalizer stops the engine-core process and the reader thread ends."""
    from shoal.frontend.core_client import AsyncMPClient

    async def main() -> tuple[int, threading.Thread]:
        client = AsyncMPClient()
        client._ensure_reader()
        reader = next(t for t in client._resources.threads if t.name == "shoal-output-reader")
        return client.engine_core_pid, reader

    pid, reader = asyncio.run(main())
    gc.collect()
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert not psutil.pid_exists(pid)


def test_in_process_engine_released_by_del_without_a_collection(tiny_checkpoints: dict) -> None:
    """An in-process engine's core, worker and model runner point at each other; `del llm`
    alone (no garbage collection) still releases its model and KV cache, so that a second engine
    made right after it finds the device free."""
    llm = LLM(str(tiny_checkpoints["llama"]), multiprocess=False, dtype="float32", max_model_len=128)
    assert llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    worker = weakref.ref(llm.engine_core.core.executor.worker)
    gc.disable()
    try:
        del llm
        assert worker() is None or worker().model_runner is None
    finally:
        gc.enable()
