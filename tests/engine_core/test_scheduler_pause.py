"""The scheduler's pause, sleep and weight-version state, driven by hand (no model runs): what
each pause mode schedules, what a sleep frees, and which version each step's tokens carry."""

from __future__ import annotations

import pytest

from shoal.engine_core.admission import Admission
from shoal.engine_core.request import RequestStatus
from shoal.step import ModelRunnerOutput
from tests.engine_core.test_scheduler import (
    add,
    assert_all_free,
    make_request,
    make_scheduler,
    outputs_by_id,
    step,
)


def started_scheduler(**kwargs: object):
    """Two requests decoding ("a", "b"), one still waiting ("c": max_num_seqs=2)."""
    scheduler = make_scheduler(max_num_seqs=2, **kwargs)  # type: ignore[arg-type]
    add(scheduler, make_request("a", 6, max_tokens=5), make_request("b", 6, max_tokens=5), make_request("c", 6))
    step(scheduler)
    step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    return scheduler


def test_abort_pause_ends_every_request_with_its_tokens_and_frees_all() -> None:
    scheduler = started_scheduler()
    aborted = scheduler.pause("abort")
    assert {o.request_id: (o.new_token_ids, o.finish_reason) for o in aborted} == {
        "a": ([], "abort"),
        "b": ([], "abort"),
        "c": ([], "abort"),
    }
    assert scheduler.admission is Admission.HOLD and not scheduler.has_work()
    assert_all_free(scheduler, 64)
    add(scheduler, make_request("d", 5, max_tokens=2))  # arrives while paused: waits
    sched_out, _ = step(scheduler)
    assert sched_out.total_num_scheduled_tokens == 0 and not scheduler.has_schedulable_requests()
    scheduler.resume()
    assert scheduler.has_work()
    sched_out, _ = step(scheduler)
    assert sched_out.num_scheduled_tokens == {"d": 5}


def test_wait_pause_runs_the_started_requests_to_their_end_and_admits_no_new_one() -> None:
    scheduler = started_scheduler()
    assert scheduler.pause("wait") == []
    assert scheduler.admission is Admission.DRAIN
    finished = {}
    while scheduler.has_work():
        sched_out, outputs = step(scheduler)
        assert "c" not in sched_out.num_scheduled_tokens
        finished |= {o.request_id: o.finish_reason for o in outputs.outputs if o.finished}
    assert finished == {"a": "length", "b": "length"}
    assert [r.request_id for r in scheduler.waiting] == ["c"] and scheduler.requests["c"].num_computed_tokens == 0
    scheduler.resume()
    sched_out, _ = step(scheduler)
    assert sched_out.num_scheduled_tokens == {"c": 6}


def test_wait_pause_readmits_a_request_preempted_while_draining() -> None:
    """Preempted requests have started: they wait at the front and are let back in."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    add(scheduler, make_request("a", 4, max_tokens=6), make_request("b", 4, max_tokens=6), make_request("c", 3))
    step(scheduler)
    scheduler.pause("wait")
    finished, preempted = set(), False
    for _ in range(40):
        if not scheduler.has_work():
            break
        _, outputs = step(scheduler)
        preempted |= scheduler.num_preemptions > 0
        finished |= {o.request_id for o in outputs.outputs if o.finish_reason == "length"}
    assert preempted and finished == {"a", "b"}
    assert list(scheduler.requests) == ["c"] and scheduler.requests["c"].status == RequestStatus.WAITING


@pytest.mark.parametrize("clear_cache", [False, True])
def test_keep_pause_freezes_running_requests_and_they_continue_after_resume(clear_cache: bool) -> None:
    scheduler = started_scheduler()
    tokens_before = {r: list(scheduler.requests[r].output_token_ids) for r in ("a", "b")}
    used_before = scheduler.kv_cache_manager.block_pool.num_used_blocks
    assert scheduler.pause("keep", clear_cache=clear_cache) == []
    sched_out, _ = step(scheduler)
    assert sched_out.total_num_scheduled_tokens == 0 and not scheduler.has_work()
    kv = scheduler.kv_cache_manager.block_pool
    if clear_cache:  # the kept requests give up their KV and are recomputed after the resume
        assert kv.num_used_blocks == 0
        assert [r.status for r in scheduler.waiting][:2] == [RequestStatus.PREEMPTED] * 2
    else:
        assert kv.num_used_blocks == used_before
    assert {r: scheduler.requests[r].output_token_ids for r in ("a", "b")} == tokens_before
    scheduler.resume()
    sched_out, outputs = step(scheduler)
    assert set(sched_out.num_scheduled_tokens) == {"a", "b"}
    if clear_cache:  # rebuilt on the workers from their tokens so far
        assert {n.req_id: n.output_token_ids for n in sched_out.new_reqs} == tokens_before
    assert set(outputs_by_id(outputs)) == {"a", "b"}


def test_resume_without_pause_and_an_unknown_mode() -> None:
    scheduler = started_scheduler()
    scheduler.resume()
    assert scheduler.admission is Admission.OPEN
    with pytest.raises(ValueError, match="pause mode"):
        scheduler.pause("retract")
    assert scheduler.pause_mode is None


def test_sleep_preempts_running_requests_forgets_the_prefix_cache_and_holds_until_wake_up() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 9, max_tokens=4))
    step(scheduler)
    cached = [b for b in scheduler.kv_cache_manager.block_pool.blocks if b.block_hash is not None]
    assert cached
    scheduler.sleep(discard_weights=False)
    assert scheduler.admission is Admission.HOLD and not scheduler.has_work()
    assert scheduler.kv_cache_manager.block_pool.num_used_blocks == 0
    assert all(b.block_hash is None for b in scheduler.kv_cache_manager.block_pool.blocks)
    sched_out, _ = step(scheduler)
    assert sched_out.total_num_scheduled_tokens == 0
    scheduler.wake_up()
    sched_out, _ = step(scheduler)
    (new,) = sched_out.new_reqs  # recomputed from scratch: no prefix hit on forgotten blocks
    assert new.num_computed_tokens == 0 and len(new.output_token_ids) == 1


def test_discarded_weights_hold_scheduling_until_the_next_weight_version() -> None:
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 5))
    scheduler.sleep(discard_weights=True)
    scheduler.wake_up()
    assert scheduler.weights_missing and not scheduler.has_work()
    assert scheduler.advance_weight_version("new") == "new"
    assert not scheduler.weights_missing and scheduler.has_work()
    # A pause outlives both.
    scheduler.pause("keep")
    scheduler.sleep(discard_weights=False)
    scheduler.wake_up()
    assert scheduler.admission is Admission.HOLD
    scheduler.resume()
    assert scheduler.admission is Admission.OPEN


def test_each_step_carries_the_weight_version_it_was_scheduled_with() -> None:
    """A step scheduled before an update ran with the old weights, even if it lands after."""
    scheduler = make_scheduler(async_scheduling=True)
    add(scheduler, make_request("a", 4, max_tokens=8))
    first = scheduler.schedule()
    scheduler.advance_weight_version("v1")
    second = scheduler.schedule()  # runs ahead on a placeholder
    out1 = scheduler.update_from_output(first, ModelRunnerOutput(["a"], [[5]], step_id=first.step_id))
    out2 = scheduler.update_from_output(second, ModelRunnerOutput(["a"], [[6]], step_id=second.step_id))
    assert (out1.weight_version, out2.weight_version) == ("0", "v1")
    assert outputs_by_id(out1) == {"a": [5]} and outputs_by_id(out2) == {"a": [6]}


def test_preempting_requests_in_flight_is_refused() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    add(scheduler, make_request("a", 4))
    scheduler.schedule()
    with pytest.raises(RuntimeError, match="in flight"):
        scheduler.preempt_all_running()


def test_a_sleep_during_a_wait_pause_keeps_the_started_requests_for_after_the_wake_up() -> None:
    scheduler = started_scheduler()
    scheduler.pause("wait")
    scheduler.sleep(discard_weights=False)
    assert not scheduler.has_work() and scheduler.has_started_requests()  # the pause is not settled
    scheduler.wake_up()
    assert scheduler.admission is Admission.DRAIN
    sched_out, _ = step(scheduler)
    assert set(sched_out.num_scheduled_tokens) == {"a", "b"}  # recomputed; "c" still waits
