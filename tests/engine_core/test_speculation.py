"""The scheduler's side of speculative decoding, driven by hand: which drafts a step carries
(cut to the budget, max_model_len and max_tokens), what the emitted tokens do to
`num_computed_tokens` and the counters, stops inside an accepted run, preemption, the per-step
and per-request switch-offs."""

from __future__ import annotations

from shoal.config import CacheConfig, SchedulerConfig
from shoal.engine_core.request import Request, RequestStatus
from shoal.engine_core.scheduler import Scheduler
from shoal.engine_core.speculation import PROBATION_TOKENS
from shoal.sampling_params import SamplingParams
from shoal.spec_decode.config import SpeculativeConfig
from shoal.step import ModelRunnerOutput, SchedulerOutput

K = 3


def make_scheduler(max_num_batched_tokens: int = 64, max_model_len: int = 1024, **config: object) -> Scheduler:
    return Scheduler(
        SchedulerConfig(8, max_num_batched_tokens, max_model_len),
        CacheConfig(block_size=4),
        64,
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=K, **config),  # type: ignore[arg-type]
    )


def make_request(request_id: str, max_tokens: int = 20, **params: object) -> Request:
    prompt = list(range(100, 108))
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), 2, max_tokens)


def run(
    scheduler: Scheduler, emit: dict[str, list[int]], drafts: dict[str, list[int]] | None = None
) -> SchedulerOutput:
    """One step whose requests emit `emit[r]` and propose `drafts[r]`."""
    step = scheduler.schedule()
    req_ids = step.scheduled_req_ids
    drafts = drafts or {}
    output = ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=[emit.get(r, []) for r in req_ids],
        spec_token_ids=[drafts.get(r, []) for r in req_ids],
        step_id=step.step_id,
    )
    scheduler.update_from_output(step, output)
    return step


def test_drafts_are_scheduled_and_rejected_ones_taken_back() -> None:
    scheduler = make_scheduler()
    request = make_request("a")
    scheduler.add_request(request)
    run(scheduler, {"a": [7]}, {"a": [8, 9, 10]})  # the prompt, then drafts for the next step
    step = scheduler.schedule()
    assert step.scheduled_spec_decode_tokens == {"a": [8, 9, 10]}
    assert step.num_scheduled_tokens == {"a": 4} and step.total_num_scheduled_tokens == 4
    output = ModelRunnerOutput(
        req_ids=["a"], sampled_token_ids=[[8, 9, 11]], spec_token_ids=[[12]], step_id=step.step_id
    )
    scheduler.update_from_output(step, output)
    # 8 and 9 accepted, 10 rejected (11 emitted in its place): computed up to 9, 11 is next.
    assert request.output_token_ids == [7, 8, 9, 11]
    assert request.num_computed_tokens == request.num_tokens - 1
    assert request.spec_token_ids == [12]
    stats = scheduler.spec_decoding_stats()
    assert stats["spec_decode_num_drafts"] == 1 and stats["spec_decode_num_draft_tokens"] == 3
    assert stats["spec_decode_num_accepted_tokens"] == 2
    assert stats["spec_decode_num_accepted_tokens_per_pos"] == [1, 1, 0]


def prefill(scheduler: Scheduler, request: Request, drafts: list[int]) -> None:
    """Run the prompt (in chunks if the budget says so); its last chunk emits 7 and drafts."""
    while request.num_output_tokens == 0:
        step = scheduler.schedule()
        done = request.num_computed_tokens >= request.num_tokens
        output = ModelRunnerOutput(
            [request.request_id], [[7] if done else []], spec_token_ids=[drafts if done else []], step_id=step.step_id
        )
        scheduler.update_from_output(step, output)


def test_drafts_cut_to_budget_max_tokens_and_max_model_len() -> None:
    cases = [
        (make_scheduler(max_num_batched_tokens=3), make_request("a"), [8, 9]),  # 1 + 2 drafts fill the budget
        (make_scheduler(), make_request("a", max_tokens=3), [8]),  # 1 emitted: 2 more at most, 1 + 1 draft
        (make_scheduler(max_model_len=11), make_request("a"), [8, 9]),  # 9 tokens: positions 9 and 10 left
    ]
    for scheduler, request, expected in cases:
        scheduler.add_request(request)
        prefill(scheduler, request, [8, 9, 10])
        step = scheduler.schedule()
        assert step.scheduled_spec_decode_tokens == {"a": expected}
        assert step.num_scheduled_tokens == {"a": 1 + len(expected)}


def test_stop_inside_an_accepted_run_and_preemption_drops_drafts() -> None:
    scheduler = make_scheduler()
    request = make_request("a", stop_token_ids=[9])
    scheduler.add_request(request)
    run(scheduler, {"a": [7]}, {"a": [8, 9, 10]})
    run(scheduler, {"a": [8, 9, 10, 11]})
    assert request.output_token_ids == [7, 8, 9] and request.status == RequestStatus.FINISHED_STOPPED
    other = make_request("b")
    scheduler.add_request(other)
    run(scheduler, {"b": [7]}, {"b": [8, 9]})
    scheduler.running.remove(other)
    scheduler._preempt(other)
    assert other.spec_token_ids == []


def test_speculation_off_above_the_batch_size_and_for_a_request_that_rejects() -> None:
    scheduler = make_scheduler(disable_by_batch_size=2)
    requests = [make_request(r, max_tokens=200) for r in "abc"]
    for request in requests:
        scheduler.add_request(request)
    run(scheduler, {r: [7] for r in "abc"}, {r: [8, 9] for r in "abc"})
    assert scheduler.schedule().scheduled_spec_decode_tokens == {}  # three running > 2

    scheduler = make_scheduler()
    request = make_request("a", max_tokens=200)
    scheduler.add_request(request)
    run(scheduler, {"a": [7]}, {"a": [8, 9, 10]})
    num_drafted_steps = 0
    while True:
        step = scheduler.schedule()
        output = ModelRunnerOutput(["a"], [[5]], spec_token_ids=[[8, 9, 10]], step_id=step.step_id)  # all rejected
        if not step.scheduled_spec_decode_tokens:
            break
        num_drafted_steps += 1
        scheduler.update_from_output(step, output)
    assert 3 <= num_drafted_steps <= 20
    # Off for PROBATION_TOKENS output tokens (this step's the first), then drafted again.
    off_at = request.num_output_tokens
    scheduler.update_from_output(step, output)
    while request.num_output_tokens < off_at + PROBATION_TOKENS:
        step = scheduler.schedule()
        assert not step.scheduled_spec_decode_tokens
        scheduler.update_from_output(step, ModelRunnerOutput(["a"], [[5]], spec_token_ids=[[8]], step_id=step.step_id))
    assert scheduler.schedule().scheduled_spec_decode_tokens == {"a": [8]}
