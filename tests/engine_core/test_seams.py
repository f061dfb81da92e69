"""The seams speculative decoding, LoRA and KV transfer will land in, with their defaults: no
draft tokens in a step, an adapter name carried from the frontend's request to the workers, and
a KV connector the scheduler asks after its prefix cache (none by default)."""

from __future__ import annotations

from shoal.engine_core.engine_core import EngineCore
from shoal.engine_core.request import Request
from shoal.protocol import EngineCoreRequest
from shoal.sampling_params import SamplingParams
from shoal.step import SchedulerOutput
from tests.engine_core.test_scheduler import EOS, add, assert_all_free, make_request, make_scheduler, step


def test_a_step_carries_no_draft_tokens_by_default() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 5, max_tokens=2))
    sched_out, _ = step(scheduler)
    assert sched_out.scheduled_spec_decode_tokens == {}
    assert scheduler.requests["a"].spec_token_ids == []
    assert SchedulerOutput([], [], {}, 0).scheduled_spec_decode_tokens == {}


def test_an_adapter_name_is_carried_from_the_frontend_request_to_the_workers() -> None:
    engine = EngineCore.__new__(EngineCore)  # only its scheduler: add_request builds the Request
    engine.scheduler = make_scheduler()
    params = SamplingParams(max_tokens=2)
    engine.add_request(EngineCoreRequest("a", [1, 2, 3], params, EOS, 0.0, 2, lora_name="sql-adapter"))
    engine.add_request(EngineCoreRequest("b", [4, 5, 6], params, EOS, 0.0, 2))
    sched_out = engine.scheduler.schedule()
    assert {r.req_id: r.lora_name for r in sched_out.new_reqs} == {"a": "sql-adapter", "b": None}


class LoadsFromElsewhere:
    """A KV connector that can load every token of a prompt but the last few, and records
    where the scheduler put them."""

    def __init__(self, num_short: int = 0) -> None:
        self.num_short = num_short
        self.asked: list[tuple[str, int]] = []
        self.loads: list[tuple[str, list[int], int, int]] = []

    def num_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        self.asked.append((request.request_id, num_computed_tokens))
        return request.num_prompt_tokens - self.num_short - num_computed_tokens

    def load_into(self, request: Request, block_ids: list[int], num_computed_tokens: int, num_tokens: int) -> None:
        self.loads.append((request.request_id, list(block_ids), num_computed_tokens, num_tokens))

    def loads_in_background(self, request: Request) -> bool:
        return False  # copied in with the request's first step

    def cancel_load(self, request: Request, workers_alive: bool = True) -> None:
        raise AssertionError("nothing loads in the background")


def test_the_scheduler_asks_the_kv_connector_after_the_prefix_cache() -> None:
    """A prefix-cache hit first, then what the connector loads: those tokens count as computed,
    their slots are allocated, the connector hears which blocks they go to, and only the rest of
    the prompt is scheduled."""
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    connector = LoadsFromElsewhere(num_short=3)
    scheduler.kv_connector = connector
    prompt = list(range(100, 114))  # 14 tokens
    add(scheduler, make_request("a", prompt[:9], max_tokens=1))
    connector.num_short = 9  # nothing to load for "a": it computes its whole prompt
    step(scheduler)
    connector.num_short = 3
    add(scheduler, make_request("b", prompt, max_tokens=2))
    sched_out, _ = step(scheduler)
    # "a" left its first two blocks (8 tokens) in the prefix cache; the connector loads 8..11.
    assert connector.asked[-1] == ("b", 8)
    [new] = sched_out.new_reqs
    assert new.num_computed_tokens == 11 and sched_out.num_scheduled_tokens == {"b": 3}
    assert connector.loads == [("b", new.block_ids, 8, 3)] and len(new.block_ids) == 4
    step(scheduler)
    assert_all_free(scheduler, 32)


def test_the_connector_never_takes_the_last_prompt_token() -> None:
    """The model runs on the last token for the first output token's logits, whatever the
    connector holds."""
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    scheduler.kv_connector = LoadsFromElsewhere(num_short=0)  # claims the whole prompt
    add(scheduler, make_request("a", 10, max_tokens=1))
    sched_out, _ = step(scheduler)
    assert sched_out.new_reqs[0].num_computed_tokens == 9 and sched_out.num_scheduled_tokens == {"a": 1}


def test_no_connector_asks_nothing() -> None:
    scheduler = make_scheduler()
    assert scheduler.kv_connector is None
    add(scheduler, make_request("a", 7, max_tokens=1))
    sched_out, _ = step(scheduler)
    assert sched_out.new_reqs[0].num_computed_tokens == 0 and sched_out.num_scheduled_tokens == {"a": 7}
