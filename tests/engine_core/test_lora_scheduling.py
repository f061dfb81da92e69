"""LoRA in the engine core, no model: at most `max_loras` adapters run at once (the others wait,
requests of running adapters and of the base model go ahead), the adapters in the scheduler's
statistics, and the adapter name in the first block's hash (adapters never share prefix-cache
blocks with each other or with the base model)."""

from __future__ import annotations

from shoal.config import CacheConfig, SchedulerConfig
from shoal.engine_core.kv_cache_manager import KVCacheManager
from shoal.engine_core.request import Request
from shoal.engine_core.scheduler import Scheduler
from shoal.sampling_params import SamplingParams
from tests.engine_core.test_scheduler import step


def _request(request_id: str, lora_name: str | None, prompt: list[int] | None = None, max_tokens: int = 2) -> Request:
    prompt = prompt or [100 + len(request_id) + i for i in range(5)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), None, max_tokens, lora_name=lora_name)


def test_at_most_max_loras_adapters_run_and_the_others_wait() -> None:
    scheduler = Scheduler(SchedulerConfig(16, 64, 1024, max_loras=2), CacheConfig(block_size=4), 64)
    for request_id, lora in [("a1", "a"), ("b1", "b"), ("c1", "c"), ("base", None), ("a2", "a")]:
        scheduler.add_request(_request(request_id, lora))
    sched_out, _ = step(scheduler)
    assert {r.req_id for r in sched_out.new_reqs} == {"a1", "b1", "base", "a2"}  # c waits, a2 and base go ahead
    stats = scheduler.make_stats()
    assert stats.running_lora_adapters == ["a", "b"] and stats.waiting_lora_adapters == ["c"] and stats.max_loras == 2
    while "c1" not in {r.req_id for r in sched_out.new_reqs}:
        assert len(scheduler.running_adapters()) <= 2
        sched_out, _ = step(scheduler)
    assert "c" in scheduler.running_adapters()


def test_without_lora_the_scheduler_reports_no_adapters() -> None:
    scheduler = Scheduler(SchedulerConfig(16, 64, 1024), CacheConfig(block_size=4), 64)
    scheduler.add_request(_request("r", None))
    step(scheduler)
    assert scheduler.make_stats().running_lora_adapters == [] and scheduler.make_stats().max_loras == 0


def test_adapters_share_no_prefix_cache_block() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    prompt = list(range(1, 14))  # three full blocks
    blocks = {}
    for request_id, lora in [("a", "adapter-a"), ("b", "adapter-b"), ("base", None)]:
        request = _request(request_id, lora, prompt)
        hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
        assert num_hit_tokens == 0 and not hit_blocks  # nothing computed under another adapter is found
        kv.allocate_slots(request, request.num_tokens)
        blocks[request_id] = set(kv.get_block_ids(request_id))
    assert not (blocks["a"] & blocks["b"]) and not (blocks["a"] & blocks["base"]) and not (blocks["b"] & blocks["base"])
    again = _request("a-again", "adapter-a", prompt)  # the same adapter does hit
    hit_blocks, num_hit_tokens = kv.get_computed_blocks(again)
    assert num_hit_tokens == 12 and {b.block_id for b in hit_blocks} <= blocks["a"]
