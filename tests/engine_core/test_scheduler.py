"""Scheduler, driven by hand: schedule(), a fake model output, update_from_output().

No model runs here. `step` samples a chosen token for every request whose tokens are all
computed after the step (the model only samples at the end of a prompt or for a decode), the
way the model runner does.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from shoal.config import CacheConfig, SchedulerConfig
from shoal.engine_core.request import Request, RequestStatus
from shoal.engine_core.scheduler import Scheduler
from shoal.protocol import EngineCoreOutputs
from shoal.sampling_params import SamplingParams
from shoal.step import LogprobsLists, ModelRunnerOutput, SchedulerOutput

EOS = 2


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    async_scheduling: bool = False,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, async_scheduling),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
    )


def make_request(
    request_id: str, prompt: list[int] | int, max_tokens: int = 8, eos_token_id: int | None = EOS, **params: object
) -> Request:
    if isinstance(prompt, int):  # distinct tokens per request id: no accidental prefix hits
        prompt = [zlib.crc32(request_id.encode()) % 100_000 * 1000 + i for i in range(prompt)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_id, max_tokens)


def add(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)


Sampler = Callable[[str], int]


def fake_model_output(scheduler: Scheduler, sched_out: SchedulerOutput, sample: Sampler) -> ModelRunnerOutput:
    """One token for each request whose tokens are all computed after this step, none otherwise."""
    req_ids, sampled = [], []
    for req_id in sched_out.num_scheduled_tokens:
        request = scheduler.requests.get(req_id)
        done = request is None or request.num_computed_tokens == request.num_tokens
        req_ids.append(req_id)
        sampled.append([sample(req_id)] if done else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, step_id=sched_out.step_id)


def step(scheduler: Scheduler, sample: Sampler | dict[str, int] | int = 7) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    if isinstance(sample, int):
        token = sample
        sample = lambda _: token  # noqa: E731
    elif isinstance(sample, dict):
        sample = sample.__getitem__
    sched_out = scheduler.schedule()
    return sched_out, scheduler.update_from_output(sched_out, fake_model_output(scheduler, sched_out, sample))


def outputs_by_id(outputs: EngineCoreOutputs) -> dict[str, list[int]]:
    return {o.request_id: o.new_token_ids for o in outputs.outputs}


def assert_all_free(scheduler: Scheduler, num_blocks: int) -> None:
    kv = scheduler.kv_cache_manager
    assert kv.block_pool.num_free_blocks == num_blocks
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    assert not kv.req_to_blocks and not kv.num_cached_blocks
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting and not scheduler.in_flight


# ---- ordering, budget, chunking, max_num_seqs -----------------------------------------------


def test_single_request_prefill_then_decode_to_max_tokens() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 10, max_tokens=4))
    sched_out, outputs = step(scheduler, 5)
    assert sched_out.num_scheduled_tokens == {"a": 10}
    assert sched_out.total_num_scheduled_tokens == 10
    (new,) = sched_out.new_reqs
    assert (new.req_id, new.block_ids, new.num_computed_tokens, new.output_token_ids) == ("a", [0, 1, 2], 0, [])
    assert new.eos_token_id == EOS
    assert sched_out.cached_reqs == [] and sched_out.step_id == 1
    assert outputs_by_id(outputs) == {"a": [5]}
    assert outputs.scheduler_stats is not None
    assert outputs.scheduler_stats.num_generation_tokens == 1
    assert outputs.scheduler_stats.num_prompt_tokens == 10

    sched_out, outputs = step(scheduler, 6)
    assert sched_out.num_scheduled_tokens == {"a": 1} and sched_out.new_reqs == []
    (cached,) = sched_out.cached_reqs
    assert (cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens) == ([5], [], 10)
    assert outputs.outputs[0].finish_reason is None

    sched_out, outputs = step(scheduler, 8)
    (cached,) = sched_out.cached_reqs
    assert (cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens) == ([6], [], 11)
    sched_out, outputs = step(scheduler, 9)
    (cached,) = sched_out.cached_reqs  # position 12 starts the fourth block
    assert (cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens) == ([8], [3], 12)
    (out,) = outputs.outputs
    assert out.new_token_ids == [9] and out.finish_reason == "length" and out.stop_reason is None
    assert (outputs.scheduler_stats.num_prompt_tokens, outputs.scheduler_stats.num_generation_tokens) == (0, 1)
    assert_all_free(scheduler, 64)
    # An empty step is not executed: the workers hear that a finished with the next real step.
    sched_out, _ = step(scheduler)
    assert sched_out.finished_req_ids == [] and sched_out.total_num_scheduled_tokens == 0
    add(scheduler, make_request("b", 3))
    sched_out, _ = step(scheduler)
    assert sched_out.finished_req_ids == ["a"] and sched_out.num_scheduled_tokens == {"b": 3}


def test_decodes_are_scheduled_before_waiting_prompts() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, make_request("a", 8), make_request("b", 8))
    sched_out, _ = step(scheduler)
    assert sched_out.num_scheduled_tokens == {"a": 8}
    add(scheduler, make_request("c", 5))
    # b was chunked out of the first step entirely (the budget was spent); a's decode goes first.
    sched_out, _ = step(scheduler)
    assert list(sched_out.num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]
    assert [r.req_id for r in sched_out.cached_reqs] == ["a"]
    assert [r.req_id for r in sched_out.new_reqs] == ["b"]
    sched_out, _ = step(scheduler)
    # b's last prompt token is a running request's work too: it comes before c.
    assert list(sched_out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 5)]


def test_token_budget_is_respected_every_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, num_blocks=128)
    add(scheduler, *(make_request(f"r{i}", 7, max_tokens=5) for i in range(6)))
    expected = [
        {"r0": 7, "r1": 7, "r2": 2},
        {"r0": 1, "r1": 1, "r2": 5, "r3": 7, "r4": 2},
        {"r0": 1, "r1": 1, "r2": 1, "r3": 1, "r4": 5, "r5": 7},
    ]
    for want in expected:
        sched_out, _ = step(scheduler)
        assert sched_out.num_scheduled_tokens == want
        assert sched_out.total_num_scheduled_tokens == sum(want.values()) <= 16
    while scheduler.has_unfinished_requests():
        sched_out, _ = step(scheduler)
        assert 0 < sched_out.total_num_scheduled_tokens <= 16


def test_chunked_prefill_of_a_long_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10, block_size=4)
    add(scheduler, make_request("long", 25, max_tokens=2))
    chunks = []
    for _ in range(3):
        sched_out, outputs = step(scheduler, 9)
        chunks.append(sched_out.num_scheduled_tokens["long"])
        assert outputs.scheduler_stats.num_prompt_tokens == chunks[-1]
        if len(chunks) < 3:
            assert outputs.outputs == []  # no token until the whole prompt is computed
    assert chunks == [10, 10, 5]
    request = scheduler.requests["long"]
    assert request.output_token_ids == [9]
    assert scheduler.kv_cache_manager.get_block_ids("long") == [0, 1, 2, 3, 4, 5, 6]


def test_chunked_prefill_sends_block_and_progress_diffs() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10, block_size=4)
    add(scheduler, make_request("long", 25, max_tokens=2))
    first, _ = step(scheduler)
    assert first.new_reqs[0].block_ids == [0, 1, 2] and first.new_reqs[0].num_computed_tokens == 0
    second, _ = step(scheduler)
    (cached,) = second.cached_reqs
    assert (cached.new_block_ids, cached.num_computed_tokens, cached.new_token_ids) == ([3, 4], 10, [])
    third, _ = step(scheduler)
    (cached,) = third.cached_reqs
    assert (cached.new_block_ids, cached.num_computed_tokens, cached.new_token_ids) == ([5, 6], 20, [])


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    add(scheduler, make_request("a", 4, max_tokens=1), make_request("b", 4, max_tokens=3), make_request("c", 4))
    sched_out, outputs = step(scheduler)
    assert list(sched_out.num_scheduled_tokens) == ["a", "b"]
    assert [o.finish_reason for o in outputs.outputs] == ["length", None]
    # a finished: c takes its seat.
    sched_out, _ = step(scheduler)
    assert list(sched_out.num_scheduled_tokens.items()) == [("b", 1), ("c", 4)]
    assert len(scheduler.running) == 2


# ---- prefix caching ----------------------------------------------------------------------------


def test_second_request_starts_after_its_prefix_hit() -> None:
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=64)
    shared = list(range(100, 120))  # five full blocks
    add(scheduler, make_request("a", [*shared, 1, 2], max_tokens=4))
    step(scheduler)
    a_blocks = scheduler.kv_cache_manager.get_block_ids("a")
    add(scheduler, make_request("b", [*shared, 3, 4, 5], max_tokens=4))
    sched_out, outputs = step(scheduler)
    assert sched_out.num_scheduled_tokens == {"a": 1, "b": 3}
    (new,) = sched_out.new_reqs
    assert new.num_computed_tokens == 20
    assert new.block_ids[:5] == a_blocks[:5]
    assert new.block_ids[5:] == [6]
    assert scheduler.requests["b"].num_cached_tokens == 20
    assert {o.request_id: o.num_cached_tokens for o in outputs.outputs} == {"a": 0, "b": 20}
    stats = outputs.scheduler_stats
    assert stats is not None and (stats.prefix_cache_queries, stats.prefix_cache_hits) == (45, 20)
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (3, 2)
    for block_id in a_blocks[:5]:
        assert scheduler.kv_cache_manager.block_pool.blocks[block_id].ref_cnt == 2


def test_identical_prompt_recomputes_its_last_block() -> None:
    scheduler = make_scheduler(block_size=4)
    prompt = list(range(100, 116))  # exactly four blocks
    add(scheduler, make_request("a", prompt, max_tokens=1))
    step(scheduler)
    add(scheduler, make_request("b", prompt, max_tokens=1))
    sched_out, _ = step(scheduler)
    assert sched_out.num_scheduled_tokens == {"b": 4}
    assert sched_out.new_reqs[0].num_computed_tokens == 12
    # a finished and its blocks were freed but kept their hashes: b shares the first three.
    assert sched_out.new_reqs[0].block_ids == [0, 1, 2, 4]


def test_prefix_hit_is_not_used_when_caching_is_disabled() -> None:
    scheduler = make_scheduler(enable_prefix_caching=False)
    prompt = list(range(100, 120))
    add(scheduler, make_request("a", prompt, max_tokens=4))
    step(scheduler)
    add(scheduler, make_request("b", prompt, max_tokens=4))
    sched_out, _ = step(scheduler)
    assert sched_out.num_scheduled_tokens == {"a": 1, "b": 20}
    assert sched_out.new_reqs[0].num_computed_tokens == 0


def test_reset_prefix_cache_forgets_hits() -> None:
    scheduler = make_scheduler()
    prompt = list(range(100, 120))
    add(scheduler, make_request("a", prompt, max_tokens=1))
    step(scheduler)
    assert scheduler.reset_prefix_cache() is True
    add(scheduler, make_request("b", prompt, max_tokens=1))
    sched_out, _ = step(scheduler)
    assert sched_out.num_scheduled_tokens == {"b": 20}


# ---- preemption --------------------------------------------------------------------------------


def test_newest_request_preempts_itself_then_resumes_with_its_tokens() -> None:
    scheduler = make_scheduler(num_blocks=5, block_size=4)
    add(scheduler, make_request("a", list(range(1, 9)), max_tokens=4))
    add(scheduler, make_request("b", list(range(101, 109)), max_tokens=3))
    sched_out, outputs = step(scheduler, {"a": 11, "b": 21})
    assert [r.block_ids for r in sched_out.new_reqs] == [[0, 1], [2, 3]]
    assert outputs_by_id(outputs) == {"a": [11], "b": [21]}

    # a takes the last free block; b needs one too and is the newest: it gives way.
    sched_out, outputs = step(scheduler, {"a": 12})
    b = scheduler.requests["b"]
    assert sched_out.num_scheduled_tokens == {"a": 1}
    assert sched_out.cached_reqs[0].new_block_ids == [4]
    assert sched_out.finished_req_ids == ["b"]  # the workers drop b's state
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(scheduler.waiting) == [b] and scheduler.running == [scheduler.requests["a"]]
    assert "b" not in scheduler.kv_cache_manager.req_to_blocks
    assert scheduler.num_preemptions == 1 and outputs.scheduler_stats.num_preemptions == 1
    assert list(scheduler.kv_cache_manager.block_pool._free) == [3, 2]

    # b's prompt blocks are still cached and free, but taking them leaves no room for a third.
    for token in (13, 14):
        sched_out, outputs = step(scheduler, {"a": token})
        assert sched_out.num_scheduled_tokens == {"a": 1}
    assert outputs.outputs[0].finish_reason == "length"
    assert outputs_by_id(outputs) == {"a": [14]}

    # a is done: b comes back as a new request carrying its output so far, after its prefix hit.
    sched_out, outputs = step(scheduler, {"b": 22})
    assert sched_out.finished_req_ids == ["a"]
    (new,) = sched_out.new_reqs
    assert new.req_id == "b"
    assert new.prompt_token_ids == list(range(101, 109))
    assert new.output_token_ids == [21]
    assert new.block_ids == [2, 3, 4]
    assert new.num_computed_tokens == 8
    assert sched_out.num_scheduled_tokens == {"b": 1}
    assert b.status == RequestStatus.RUNNING and b.num_preemptions == 1

    sched_out, outputs = step(scheduler, {"b": 23})
    assert sched_out.cached_reqs[0].new_token_ids == [22]
    assert outputs.outputs[0].finish_reason == "length"
    assert b.output_token_ids == [21, 22, 23]
    assert_all_free(scheduler, 5)


def test_older_request_preempts_the_newest_and_its_tail_block_is_evicted_first() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    add(scheduler, make_request("a", list(range(1, 9)), max_tokens=2))
    add(scheduler, make_request("b", list(range(101, 109)), max_tokens=2))
    step(scheduler, {"a": 11, "b": 21})
    sched_out, outputs = step(scheduler, {"a": 12})
    # b is freed tail first, so a's new block is b's last block; b's first block keeps its hash.
    assert sched_out.num_scheduled_tokens == {"a": 1}
    assert sched_out.cached_reqs[0].new_block_ids == [3]
    assert sched_out.finished_req_ids == ["b"]
    assert outputs.outputs[0].finish_reason == "length"
    sched_out, outputs = step(scheduler, {"b": 22})
    (new,) = sched_out.new_reqs
    assert (new.req_id, new.output_token_ids, new.num_computed_tokens) == ("b", [21], 4)
    assert new.block_ids[0] == 2
    assert sched_out.num_scheduled_tokens == {"b": 5}
    assert outputs_by_id(outputs) == {"b": [22]}
    assert scheduler.requests == {}
    assert_all_free(scheduler, 4)


def test_no_new_request_is_admitted_in_a_step_that_preempted() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    add(scheduler, make_request("a", 8, max_tokens=4), make_request("b", 8, max_tokens=4))
    step(scheduler)
    add(scheduler, make_request("c", 1))
    sched_out, _ = step(scheduler)
    assert sched_out.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


# ---- stopping ----------------------------------------------------------------------------------


def run_to_end(scheduler: Scheduler, tokens: list[int]) -> list:
    """Feed `tokens` one per step to the only request; returns its outputs."""
    outs = []
    for token in tokens:
        _, outputs = step(scheduler, token)
        outs.extend(outputs.outputs)
        if outs and outs[-1].finished:
            break
    return outs


def test_finishes_on_eos() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 5, max_tokens=10))
    outs = run_to_end(scheduler, [7, 8, EOS, 9])
    assert [o.new_token_ids for o in outs] == [[7], [8], [EOS]]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", None)
    assert_all_free(scheduler, 64)


def test_finishes_on_max_tokens() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 5, max_tokens=3))
    outs = run_to_end(scheduler, [7, 8, 9, 10])
    assert [o.new_token_ids for o in outs] == [[7], [8], [9]]
    assert outs[-1].finish_reason == "length"
    assert [o.finish_reason for o in outs[:-1]] == [None, None]


def test_finishes_on_a_stop_token_with_it_as_stop_reason() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 5, max_tokens=10, stop_token_ids=[30, 31]))
    outs = run_to_end(scheduler, [7, 31, 9])
    assert [o.new_token_ids for o in outs] == [[7], [31]]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", 31)


def test_eos_is_ignored_with_ignore_eos() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 5, max_tokens=3, ignore_eos=True))
    outs = run_to_end(scheduler, [EOS, EOS, EOS, EOS])
    assert [o.new_token_ids for o in outs] == [[EOS], [EOS], [EOS]]
    assert outs[-1].finish_reason == "length"


def test_eos_before_min_tokens_does_not_stop() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 5, max_tokens=10, min_tokens=3, stop_token_ids=[30]))
    outs = run_to_end(scheduler, [EOS, 30, EOS, 8])
    assert [o.new_token_ids for o in outs] == [[EOS], [30], [EOS]]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", None)


def test_request_without_eos_token_never_stops_on_it() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 5, max_tokens=2, eos_token_id=None))
    outs = run_to_end(scheduler, [EOS, EOS])
    assert outs[-1].finish_reason == "length"


def test_finishes_at_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=8)
    add(scheduler, make_request("a", 6, max_tokens=10))
    outs = run_to_end(scheduler, [7, 8, 9])
    assert [o.new_token_ids for o in outs] == [[7], [8]]
    assert outs[-1].finish_reason == "length"


def test_only_the_tokens_up_to_the_stop_are_accepted() -> None:
    """Several tokens sampled in one step (speculative decoding): the ones after a stop are dropped."""
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 5, max_tokens=10))
    sched_out = scheduler.schedule()
    model_output = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7, EOS, 9]])
    outputs = scheduler.update_from_output(sched_out, model_output)
    assert outputs.outputs[0].new_token_ids == [7, EOS]
    assert outputs.outputs[0].finish_reason == "stop"


def test_prompt_logprobs_reach_the_frontend_once_across_a_preemption() -> None:
    """Like the model runner: each step returns a row for every prompt position it computed
    (position p predicts prompt token p + 1); a recomputed prompt must not send its rows again."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=6)
    prompt = list(range(100, 110))
    add(scheduler, make_request("a", 4, max_tokens=4))
    add(scheduler, make_request("b", prompt, max_tokens=1, prompt_logprobs=1))
    received: list[float] = []
    for _ in range(8):
        sched_out = scheduler.schedule()
        if not sched_out.num_scheduled_tokens:
            break
        model_output = fake_model_output(scheduler, sched_out, lambda _: 7)
        if "b" in sched_out.num_scheduled_tokens:
            b = scheduler.requests["b"]
            end = b.num_computed_tokens
            first = end - sched_out.num_scheduled_tokens["b"]
            positions = range(first, min(end, len(prompt) - 1))
            model_output.prompt_logprobs["b"] = LogprobsLists(
                token_ids=[[prompt[p + 1]] for p in positions],
                logprobs=[[-float(p)] for p in positions],
                ranks=[1] * len(positions),
            )
        for output in scheduler.update_from_output(sched_out, model_output).outputs:
            if output.request_id == "b" and output.new_prompt_logprobs is not None:
                received.extend(row[0] for row in output.new_prompt_logprobs.logprobs)
    assert scheduler.num_preemptions == 1
    assert not scheduler.requests
    assert received == [-float(p) for p in range(len(prompt) - 1)]


# ---- aborts and what the workers hear -------------------------------------------------------


def test_abort_waiting_and_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, make_request("running", 6), make_request("waiting", 6))
    step(scheduler)
    assert [r.request_id for r in scheduler.waiting] == ["waiting"]
    assert scheduler.kv_cache_manager.get_block_ids("running") == [0, 1]
    running, waiting = scheduler.requests["running"], scheduler.requests["waiting"]
    scheduler.abort_requests(["waiting", "running", "unknown"])
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert running.finish_reason == "abort"
    assert_all_free(scheduler, 64)
    empty = scheduler.schedule()
    assert empty.total_num_scheduled_tokens == 0 and empty.finished_req_ids == []
    scheduler.abort_requests(["running"])  # twice is harmless
    add(scheduler, make_request("next", 3))
    sched_out, _ = step(scheduler)
    assert sched_out.finished_req_ids == ["waiting", "running"]
    assert sched_out.num_scheduled_tokens == {"next": 3}


def test_abort_while_the_step_runs_drops_its_tokens() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 6), make_request("b", 6))
    sched_out = scheduler.schedule()
    scheduler.abort_requests(["a"])
    model_output = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[5], [6]])
    outputs = scheduler.update_from_output(sched_out, model_output)
    assert outputs_by_id(outputs) == {"b": [6]}
    assert not scheduler.in_flight
    assert scheduler.schedule().finished_req_ids == ["a"]


def test_abort_of_a_preempted_request() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    add(scheduler, make_request("a", 8), make_request("b", 8))
    step(scheduler)
    step(scheduler)
    assert scheduler.requests["b"].status == RequestStatus.PREEMPTED
    scheduler.abort_requests(["b"])
    assert [r.request_id for r in scheduler.waiting] == []
    assert "b" not in scheduler.requests
    scheduler.abort_requests(["a"])
    assert_all_free(scheduler, 4)


def test_finished_requests_are_reported_to_workers_once() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4, max_tokens=1), make_request("b", 4, max_tokens=2))
    first, _ = step(scheduler)
    assert first.finished_req_ids == []
    second, _ = step(scheduler)
    assert second.finished_req_ids == ["a"]
    third, _ = step(scheduler)
    assert third.finished_req_ids == [] and third.total_num_scheduled_tokens == 0
    add(scheduler, make_request("c", 4, max_tokens=1))
    fourth, _ = step(scheduler)
    assert fourth.finished_req_ids == ["b"]
    fifth, _ = step(scheduler)
    assert fifth.finished_req_ids == [] and fifth.total_num_scheduled_tokens == 0
    add(scheduler, make_request("d", 4, max_tokens=1))
    assert scheduler.schedule().finished_req_ids == ["c"]


def test_cached_request_data_carries_exactly_the_new_tokens() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4, max_num_seqs=4)
    add(scheduler, make_request("a", 3, max_tokens=20))
    sampled = iter(range(100, 200))
    seen: list[int] = []
    for _ in range(6):
        sched_out, _ = step(scheduler, lambda _: next(sampled))
        for cached in sched_out.cached_reqs:
            seen.extend(cached.new_token_ids)
    request = scheduler.requests["a"]
    # Everything sampled except the token of the last step, which the next step will carry.
    assert seen == request.output_token_ids[:-1] == list(range(100, 105))
    assert request.num_output_tokens_sent == 5


def test_pipelined_steps_do_not_reschedule_requests_in_flight() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4), make_request("b", 4))
    first = scheduler.schedule()
    assert list(first.num_scheduled_tokens) == ["a", "b"]
    assert not scheduler.has_schedulable_requests()
    add(scheduler, make_request("c", 4))
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"c": 4}
    scheduler.update_from_output(first, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[5], [6]]))
    assert scheduler.has_schedulable_requests()
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"a": 1, "b": 1}
    assert (first.step_id, second.step_id, third.step_id) == (1, 2, 3)


def test_a_request_in_flight_is_never_preempted() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    add(scheduler, make_request("a", 8))
    first = scheduler.schedule()
    add(scheduler, make_request("b", 8))
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"b": 8}
    scheduler.update_from_output(first, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5]]))
    third = scheduler.schedule()  # b's prompt is still executing while this step is built
    # a needs a third block; b is newer but in flight, so a gives way itself.
    assert third.num_scheduled_tokens == {}
    assert scheduler.requests["a"].status == RequestStatus.PREEMPTED
    assert scheduler.requests["b"].status == RequestStatus.RUNNING
    assert scheduler.kv_cache_manager.get_block_ids("b") == [2, 3]
    # The empty step is not executed; the preemption reaches the workers with the next one.
    assert third.finished_req_ids == []
    scheduler.update_from_output(second, ModelRunnerOutput(req_ids=["b"], sampled_token_ids=[[6]]))
    fourth = scheduler.schedule()
    assert fourth.num_scheduled_tokens == {"b": 1} and fourth.finished_req_ids == ["a"]


# ---- async scheduling: decodes run one step ahead of their sampled tokens ------------------


def test_async_decode_is_scheduled_again_while_its_step_runs() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    add(scheduler, make_request("a", 4, max_tokens=8))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 4}
    assert scheduler.requests["a"].num_output_placeholders == 1
    second = scheduler.schedule()  # the prompt's sample is still in flight
    assert second.num_scheduled_tokens == {"a": 1}
    assert second.cached_reqs[0].new_token_ids == [] and second.cached_reqs[0].num_computed_tokens == 4
    assert scheduler.requests["a"].num_output_placeholders == 2
    assert scheduler.in_flight["a"] == 2
    outputs = scheduler.update_from_output(first, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5]]))
    assert outputs_by_id(outputs) == {"a": [5]}
    assert scheduler.requests["a"].num_output_placeholders == 1
    third = scheduler.schedule()  # the workers now hear of the first sample
    assert third.num_scheduled_tokens == {"a": 1} and third.cached_reqs[0].new_token_ids == [5]
    assert third.cached_reqs[0].num_computed_tokens == 5


@pytest.mark.parametrize(
    "params",
    [{"repetition_penalty": 1.2}, {"frequency_penalty": 0.5}, {"presence_penalty": 0.5}, {"min_tokens": 3}],
)
def test_async_waits_for_tokens_its_sampler_needs(params: dict) -> None:
    scheduler = make_scheduler(async_scheduling=True)
    add(scheduler, make_request("a", 4, max_tokens=8, **params), make_request("b", 4, max_tokens=8))
    first = scheduler.schedule()
    assert scheduler.schedule().num_scheduled_tokens == {"b": 1}
    scheduler.update_from_output(first, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[5], [6]]))
    assert "a" in scheduler.schedule().num_scheduled_tokens


def test_async_does_not_run_past_max_tokens_or_max_model_len() -> None:
    scheduler = make_scheduler(async_scheduling=True, max_model_len=6)
    add(scheduler, make_request("a", 4, max_tokens=2), make_request("b", 4, max_tokens=100))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 1, "b": 1}
    # a's two tokens are both in flight, and so are b's 5th and 6th: max_model_len.
    assert scheduler.schedule().num_scheduled_tokens == {}
    scheduler.update_from_output(first, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[5], [6]]))
    outputs = scheduler.update_from_output(second, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[7], [8]]))
    assert {o.request_id: o.finish_reason for o in outputs.outputs} == {"a": "length", "b": "length"}
    assert_all_free(scheduler, 64)


def test_async_step_after_a_stop_is_dropped_and_frees_everything() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    add(scheduler, make_request("a", 4, max_tokens=8), make_request("b", 4, max_tokens=8))
    first = scheduler.schedule()
    second = scheduler.schedule()
    outputs = scheduler.update_from_output(first, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[EOS], [6]]))
    assert {o.request_id: o.finish_reason for o in outputs.outputs} == {"a": "stop", "b": None}
    outputs = scheduler.update_from_output(second, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[9], [7]]))
    assert outputs_by_id(outputs) == {"b": [7]}  # a's step past its stop is dropped
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"b": 1} and third.finished_req_ids == ["a"]
    scheduler.abort_requests(["b"])
    scheduler.update_from_output(third, ModelRunnerOutput(req_ids=["b"], sampled_token_ids=[[1]]))
    assert_all_free(scheduler, 64)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_reused_request_id_gets_nothing_of_the_aborted_requests_step(async_scheduling: bool) -> None:
    scheduler = make_scheduler(async_scheduling=async_scheduling)
    add(scheduler, make_request("a", [11, 12, 13, 14]))
    first = scheduler.schedule()
    scheduler.abort_requests(["a"])
    add(scheduler, make_request("a", [21, 22, 23, 24, 25, 26]))  # a new request, the same id
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 6} and second.finished_req_ids == ["a"]
    outputs = scheduler.update_from_output(first, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5]]))
    assert outputs_by_id(outputs) == {}
    new = scheduler.requests["a"]
    assert new.output_token_ids == [] and scheduler.in_flight["a"] == 1 and new.num_output_placeholders == 1
    outputs = scheduler.update_from_output(second, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[9]]))
    assert outputs_by_id(outputs) == {"a": [9]} and new.num_output_placeholders == 0 and not scheduler.in_flight


def test_duplicate_request_id_is_rejected() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4))
    with pytest.raises(ValueError, match="already running"):
        add(scheduler, make_request("a", 4))


# ---- a randomized soak with a worker that checks every diff and every KV read --------------


@dataclass
class WorkerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    # prefix_keys[i] stands for the KV of position i: it depends on every token up to i.
    prefix_keys: list[int] = field(default_factory=list)

    def key(self, position: int, token_ids: list[int]) -> int:
        while len(self.prefix_keys) <= position:
            i = len(self.prefix_keys)
            parent = self.prefix_keys[i - 1] if i else 0
            self.prefix_keys.append(hash((parent, token_ids[i])))
        return self.prefix_keys[position]


class FakeWorker:
    """Applies the scheduler's diffs like the model runner, writes fake KV into the paged cache,
    and checks that every position a request attends to holds that request's own KV."""

    def __init__(self, num_blocks: int, block_size: int, sample: Callable[[str, int], int]) -> None:
        self.block_size = block_size
        # The previous step's samples: async scheduling feeds them back before the engine has them.
        self.last_sampled: dict[str, int] = {}
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.requests: dict[str, WorkerRequest] = {}
        self.prompt_lens: dict[str, int] = {}
        self.sample = sample

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.new_reqs:
            assert new.req_id not in self.requests
            self.prompt_lens[new.req_id] = len(new.prompt_token_ids)
            tokens = new.prompt_token_ids + new.output_token_ids
            self.requests[new.req_id] = WorkerRequest(tokens, list(new.block_ids), new.num_computed_tokens)
        for cached in out.cached_reqs:
            state = self.requests[cached.req_id]
            assert cached.num_computed_tokens == state.num_computed_tokens
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
        assert [*out.num_scheduled_tokens] == [r.req_id for r in out.cached_reqs] + [r.req_id for r in out.new_reqs]
        # Every layer writes the whole batch's KV before attending, so write everything first.
        inputs: dict[str, list[int]] = {}
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            end = state.num_computed_tokens + num_tokens
            inputs[req_id] = state.token_ids
            if end > len(state.token_ids):  # async scheduling: the last token is still in flight
                assert end == len(state.token_ids) + 1 and req_id in self.last_sampled
                inputs[req_id] = [*state.token_ids, self.last_sampled[req_id]]
            assert end <= len(state.block_ids) * self.block_size
            for position in range(state.num_computed_tokens, end):
                self._slot_write(state, position, state.key(position, inputs[req_id]))
        req_ids, sampled = [], []
        self.last_sampled = {}
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            state.num_computed_tokens += num_tokens
            for position in range(state.num_computed_tokens):
                block_id = state.block_ids[position // self.block_size]
                key = state.key(position, inputs[req_id])
                assert self.kv[block_id][position % self.block_size] == key, (req_id, position)
            req_ids.append(req_id)
            done = state.num_computed_tokens == len(inputs[req_id])
            if done:
                self.last_sampled[req_id] = self.sample(req_id, state.num_computed_tokens - self.prompt_lens[req_id])
            sampled.append([self.last_sampled[req_id]] if done else [])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, step_id=out.step_id)

    def _slot_write(self, state: WorkerRequest, position: int, key: int) -> None:
        self.kv[state.block_ids[position // self.block_size]][position % self.block_size] = key


def check_invariants(scheduler: Scheduler, out: SchedulerOutput) -> None:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    holders = Counter(block.block_id for blocks in kv.req_to_blocks.values() for block in blocks)
    assert {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt} == dict(holders)
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    assert all(b.block_hash == h for h, b in pool._cached.items())
    assert set(kv.req_to_blocks) == {r.request_id for r in scheduler.running}
    running = {r.request_id for r in scheduler.running}
    waiting = {r.request_id for r in scheduler.waiting}
    assert not running & waiting and running | waiting == set(scheduler.requests)
    assert all(r.status == RequestStatus.RUNNING for r in scheduler.running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in scheduler.waiting)
    assert len(scheduler.running) <= scheduler.max_num_seqs
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= scheduler.max_num_batched_tokens
    for request in scheduler.running:
        num_blocks = len(kv.req_to_blocks[request.request_id])
        assert num_blocks == -(-request.num_computed_tokens // kv.block_size)


def sampled_token(req_id: str, index: int) -> int:
    """The fake model is deterministic, so a recomputed request samples the same tokens again."""
    return 1000 + (int(req_id[1:]) * 7919 + index * 104729) % 50000


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("steps_in_flight, async_scheduling", [(1, False), (2, False), (2, True)])
def test_randomized_soak_leaks_nothing(seed: int, steps_in_flight: int, async_scheduling: bool) -> None:
    rng = random.Random(seed)
    block_size, num_blocks, num_requests = 4, 40, 150
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=12,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    )
    worker = FakeWorker(num_blocks, block_size, sampled_token)
    shared_prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(4)]
    pending: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    expected: dict[str, int] = {}
    received: dict[str, list[int]] = {}
    finish_reasons: dict[str, str] = {}
    aborted: set[str] = set()
    next_request = 0
    num_ran_ahead = 0  # requests scheduled again while a step of theirs was in flight

    for _ in range(20_000):
        # Arrivals: a few at a time, half of them sharing a prefix (sometimes a whole prompt).
        while next_request < num_requests and rng.random() < 0.5:
            req_id = f"r{next_request}"
            next_request += 1
            prompt = rng.choice(shared_prefixes) if rng.random() < 0.5 else []
            prompt = prompt + [rng.randrange(50) for _ in range(rng.randrange(0 if prompt else 1, 40))]
            expected[req_id] = rng.randrange(1, 25)
            received[req_id] = []
            scheduler.add_request(Request(req_id, prompt, SamplingParams(), None, expected[req_id]))
        if rng.random() < 0.05 and scheduler.requests:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.abort_requests([victim])
            aborted.add(victim)
        while len(pending) < steps_in_flight and scheduler.has_schedulable_requests():
            in_flight = set(scheduler.in_flight)
            out = scheduler.schedule()
            num_ran_ahead += len(in_flight & set(out.num_scheduled_tokens))
            check_invariants(scheduler, out)
            if out.total_num_scheduled_tokens == 0:
                break  # like EngineCore.step: an empty step is not executed
            pending.append((out, worker.execute(out)))
            for req_id in out.num_scheduled_tokens:
                if req_id in scheduler.requests:
                    assert worker.requests[req_id].block_ids == scheduler.kv_cache_manager.get_block_ids(req_id)
        if pending:
            out, model_output = pending.pop(0)
            for output in scheduler.update_from_output(out, model_output).outputs:
                assert output.request_id not in finish_reasons
                received[output.request_id].extend(output.new_token_ids)
                if output.finished:
                    finish_reasons[output.request_id] = output.finish_reason
        if next_request == num_requests and not scheduler.has_unfinished_requests() and not pending:
            break
    else:
        pytest.fail("the simulation did not finish")

    assert_all_free(scheduler, num_blocks)
    # The workers hold nothing that they will not be told to drop.
    assert set(worker.requests) <= set(scheduler._finished_req_ids)
    assert scheduler.num_preemptions > 0, "the cache was meant to be small enough to preempt"
    assert scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    assert aborted and len(aborted) < num_requests
    assert (num_ran_ahead > 100) if async_scheduling else (num_ran_ahead == 0)
    for req_id, max_tokens in expected.items():
        want = [sampled_token(req_id, i) for i in range(max_tokens)]
        if req_id in aborted and req_id not in finish_reasons:
            assert received[req_id] == want[: len(received[req_id])]
        else:
            assert received[req_id] == want, req_id
            assert finish_reasons[req_id] == "length"


def test_weight_version_advances_by_count_or_by_name() -> None:
    scheduler = make_scheduler()
    assert scheduler.weight_version == "0"
    assert scheduler.advance_weight_version() == "1"
    assert scheduler.advance_weight_version("step-7") == "step-7"
    assert scheduler.weight_version == "step-7"
    assert scheduler.advance_weight_version() == "3"
