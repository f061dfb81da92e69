"""A worker actor that dies is re-created and the engine carries on with the same greedy tokens;
past `max_worker_restarts` the next death is `EngineDeadError` within seconds, in generate()
and in the health check, never a hang (its peers stay blocked in a collective with it), and
the engine's workers and placement group are gone."""

from __future__ import annotations

import time
from typing import Any

import pytest

from shoal import LLM, SamplingParams
from shoal.errors import EngineDeadError

PROMPTS = ["The quick brown fox", "Hello world! This is a longer prompt of several words"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def kill_and_wait(actor: Any) -> None:
    """Kill a worker actor and return once it is gone: `ray.kill` returns first, and an actor
    still answering would let the next generate() pass without meeting the death."""
    import ray

    ray.kill(actor)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue
        time.sleep(0.01)
    raise AssertionError("the killed actor still answers")


@pytest.mark.parametrize(
    ("tp", "pp", "first_killed", "second_killed"),
    [
        (2, 1, 1, 0),  # the survivor waits in an all-reduce; then rank 0, which hosts the rendezvous
        (1, 2, 0, 1),  # the last stage waits for the first stage's hidden states; then the last
    ],
)
def test_killed_worker_is_restarted_until_the_limit(
    ray_cluster: dict, tiny_checkpoints: dict, tp: int, pp: int, first_killed: int, second_killed: int
) -> None:
    import ray

    llm = LLM(
        str(tiny_checkpoints["llama"]),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_worker_restarts=1,
        multiprocess=False,
    )
    executor = llm.engine_core.core.executor
    placement_group = executor.placement_group
    try:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        killed = executor.workers[first_killed]
        kill_and_wait(killed)
        # The next step meets the dead worker; it is re-created and the requests recomputed.
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert executor.workers[first_killed] is not killed
        stats = llm.get_stats()
        assert stats["num_worker_restarts"] == 1 and stats["num_used_blocks"] == 0
        executor.check_health()

        kill_and_wait(executor.workers[second_killed])
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=f"worker rank {second_killed} died.*max_worker_restarts=1"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert time.monotonic() - start < 20
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.engine_core.core.check_health()
        assert time.monotonic() - start < 10
        # Past the limit the engine shut its workers down at once.
        assert executor.workers == []
    finally:
        llm.shutdown()
    # The executor created the placement group, so shutdown removed it.
    assert ray.util.placement_group_table(placement_group)["state"] == "REMOVED"
