"""A worker that dies turns into `EngineDeadError` within seconds, in generate() and in the
health check, never a hang (its peers stay blocked in a collective with it)."""

from __future__ import annotations

import time

import pytest

from shoal import LLM, SamplingParams
from shoal.errors import EngineDeadError


@pytest.mark.parametrize(
    ("tp", "pp", "killed_rank"),
    [
        (2, 1, 1),  # rank 0 waits for rank 1 in an all-reduce
        (1, 2, 0),  # the last stage waits for the first stage's hidden states
    ],
)
def test_killed_worker_raises_engine_dead_error_quickly(
    ray_cluster: dict, tiny_checkpoints: dict, tp: int, pp: int, killed_rank: int
) -> None:
    import ray

    llm = LLM(str(tiny_checkpoints["llama"]), tensor_parallel_size=tp, pipeline_parallel_size=pp, multiprocess=False)
    executor = llm.engine_core.core.executor
    placement_group = executor.placement_group
    try:
        executor.check_health()
        ray.kill(executor.workers[killed_rank])

        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=f"worker rank {killed_rank} died"):
            llm.generate("The quick brown fox", SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 10

        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.engine_core.core.check_health()
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()
    # The executor created the placement group, so shutdown removed it.
    assert ray.util.placement_group_table(placement_group)["state"] == "REMOVED"
