"""What the engine core does when workers die: the scheduler requeues every running request
for recompute (their tokens kept, the lost steps forgotten, nothing leaked), the restart budget
allows `max_worker_restarts` restarts within any window, and `EngineCore` (over a stand-in
executor) restarts, or shuts down and raises `EngineDeadError` past the budget, after an
in-place weight update or while asleep."""

from __future__ import annotations

import pytest

from shoal.config import EngineArgs
from shoal.engine_core.engine_core import EngineCore
from shoal.engine_core.request import RequestStatus
from shoal.engine_core.worker_restarts import RestartBudget
from shoal.errors import EngineDeadError, WorkerDiedError
from shoal.executors.abstract import Executor
from shoal.protocol import EngineCoreOutputs, EngineCoreRequest
from shoal.sampling_params import SamplingParams
from shoal.step import ModelRunnerOutput
from tests.engine_core.test_scheduler import add, assert_all_free, make_request, make_scheduler, run_to_end, step


def test_requeue_keeps_sent_tokens_and_recomputes_them() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    add(scheduler, make_request("a", 6, max_tokens=6), make_request("b", 5, max_tokens=6))
    step(scheduler, 10)
    step(scheduler, 11)  # a and b have two output tokens each
    add(scheduler, make_request("c", 3, max_tokens=2))  # still waiting: untouched by the requeue
    lost = scheduler.schedule()  # this step's output never comes back (its worker died)
    assert set(lost.num_scheduled_tokens) == {"a", "b", "c"}

    assert scheduler.requeue_for_recompute() == 3
    assert not scheduler.running and not scheduler.in_flight
    assert [r.request_id for r in scheduler.waiting] == ["a", "b", "c"]
    assert all(r.status == RequestStatus.PREEMPTED for r in scheduler.waiting)
    assert scheduler.kv_cache_manager.block_pool.num_used_blocks == 0
    assert scheduler.requests["a"].output_token_ids == [10, 11]

    # The workers are new: the next step sends every request whole, its outputs included, and
    # nothing about finished requests they never knew; the prefix cache gives no stale hit.
    again = scheduler.schedule()
    assert [(r.req_id, r.output_token_ids, r.num_computed_tokens) for r in again.new_reqs] == [
        ("a", [10, 11], 0),
        ("b", [10, 11], 0),
        ("c", [], 0),
    ]
    assert again.num_scheduled_tokens == {"a": 8, "b": 7, "c": 3}
    assert again.finished_req_ids == [] and again.cached_reqs == []
    # The lost step's output, should it arrive late after all, changes nothing.
    late = scheduler.update_from_output(lost, ModelRunnerOutput(req_ids=["a", "b", "c"], sampled_token_ids=[[99]] * 3))
    assert late.outputs == []
    outputs = scheduler.update_from_output(
        again, ModelRunnerOutput(req_ids=["a", "b", "c"], sampled_token_ids=[[12], [12], [12]])
    )
    assert {o.request_id: o.new_token_ids for o in outputs.outputs} == {"a": [12], "b": [12], "c": [12]}
    for _ in range(8):
        step(scheduler, 13)
    assert_all_free(scheduler, 32)


def test_requeue_with_several_steps_in_flight_and_placeholders() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    add(scheduler, make_request("a", 4, max_tokens=8))
    scheduler.schedule()
    scheduler.schedule()  # a runs one step ahead: two steps in flight, two placeholders
    request = scheduler.requests["a"]
    assert request.num_steps_in_flight == 2 and request.num_output_placeholders == 2
    scheduler.requeue_for_recompute()
    assert request.num_steps_in_flight == 0 and request.num_output_placeholders == 0
    assert request.num_computed_tokens == 0 and scheduler.has_schedulable_requests()
    assert scheduler.schedule().num_scheduled_tokens == {"a": 4}


def test_requeue_drops_prefix_cache_hits() -> None:
    scheduler = make_scheduler(block_size=4)
    add(scheduler, make_request("a", list(range(100, 112)), max_tokens=1))
    run_to_end(scheduler, [7])
    scheduler.requeue_for_recompute()
    add(scheduler, make_request("b", list(range(100, 112)), max_tokens=1))
    (new,) = scheduler.schedule().new_reqs
    assert new.num_computed_tokens == 0  # the cached blocks' KV is gone with the old workers


def test_restart_budget_counts_within_a_sliding_window() -> None:
    now = [0.0]
    budget = RestartBudget(max_restarts=2, window_s=10.0, clock=lambda: now[0])
    assert budget.take()
    now[0] = 5.0
    assert budget.take()
    now[0] = 9.9
    assert not budget.take()  # a third within 10 s
    now[0] = 10.0  # the first has left the window
    assert budget.take() and budget.num_recent == 2
    assert not budget.take()
    now[0] = 100.0
    assert budget.take() and budget.num_restarts == 4


def test_no_restarts_allowed() -> None:
    assert not RestartBudget(max_restarts=0, window_s=1.0).take()


@pytest.mark.parametrize(("field", "value"), [("max_worker_restarts", -1), ("worker_restart_window_s", 0.0)])
def test_restart_arguments_are_validated(tiny_checkpoints: dict, field: str, value: float) -> None:
    from shoal.config import EngineArgs

    with pytest.raises(ValueError, match=field):
        EngineArgs(model=str(tiny_checkpoints["llama"]), device="cpu", **{field: value}).create_engine_config()


# ---- EngineCore over an executor whose workers die on demand -------------------------------


class FlakyExecutor(Executor):
    """A stand-in executor: every scheduled request samples token 7, except that the step after
    `kill()` fails as a Ray worker's death does."""

    def _init_workers(self) -> None:
        self.dying = False
        self.restarts: list[tuple[list[int], int]] = []
        self.is_shut_down = False

    def kill(self) -> None:
        self.dying = True

    def initialize_kv_cache(self) -> int:
        return 64

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        return [0]  # (a worker's answer: `sleep` returns the bytes it freed)

    def execute_model(self, scheduler_output, non_block=False):
        if self.dying:
            self.dying = False
            raise WorkerDiedError([1], "worker rank 1 died during a step")
        req_ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[7] for _ in req_ids])

    def check_health(self) -> None:
        if self.dying:
            self.dying = False
            raise WorkerDiedError([0], "worker rank 0 found dead by a health check")

    def restart_workers(self, ranks: list[int], num_kv_blocks: int) -> None:
        self.restarts.append((ranks, num_kv_blocks))

    def shutdown(self) -> None:
        self.is_shut_down = True


@pytest.fixture
def engine(tiny_checkpoints: dict) -> EngineCore:
    args = EngineArgs(model=str(tiny_checkpoints["llama"]), device="cpu", max_worker_restarts=1)
    config = args.create_engine_config()
    return EngineCore(config, executor=FlakyExecutor(config))


def _add(engine: EngineCore, request_id: str, max_tokens: int = 4) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(EngineCoreRequest(request_id, [11, 12, 13, 14, 15], params, None, 0.0, max_tokens))


def _tokens(outputs: EngineCoreOutputs) -> dict[str, list[int]]:
    return {o.request_id: o.new_token_ids for o in outputs.outputs}


def test_engine_core_restarts_then_shuts_down_past_the_budget(engine: EngineCore) -> None:
    executor = engine.executor
    assert isinstance(executor, FlakyExecutor)
    _add(engine, "a")
    sent = _tokens(engine.step())["a"]  # one token out
    executor.kill()
    assert _tokens(engine.step()) == {}  # the step was lost; nothing is sent twice
    assert executor.restarts == [([1], 64)]
    assert engine.get_stats()["num_worker_restarts"] == 1
    while engine.has_unfinished_requests():
        sent += _tokens(engine.step()).get("a", [])
    assert sent == [7, 7, 7, 7] and engine.get_stats()["num_used_blocks"] == 0

    _add(engine, "b")
    executor.kill()
    with pytest.raises(EngineDeadError, match=r"worker rank 1 died.*max_worker_restarts=1"):
        engine.step()
    assert executor.is_shut_down and executor.restarts == [([1], 64)]


def test_engine_core_restarts_a_worker_its_health_check_found_dead(engine: EngineCore) -> None:
    executor = engine.executor
    assert isinstance(executor, FlakyExecutor)
    executor.kill()
    engine.check_health()
    assert executor.restarts == [([0], 64)]


def test_engine_core_never_restarts_after_an_in_place_weight_update(engine: EngineCore) -> None:
    executor = engine.executor
    assert isinstance(executor, FlakyExecutor)
    engine.scheduler.advance_weight_version()
    _add(engine, "a")
    executor.kill()
    with pytest.raises(EngineDeadError, match="weights were updated in place"):
        engine.step()
    assert executor.restarts == [] and executor.is_shut_down


def test_engine_core_never_restarts_while_asleep(engine: EngineCore) -> None:
    executor = engine.executor
    assert isinstance(executor, FlakyExecutor)
    engine.sleep(level=1)
    executor.kill()
    with pytest.raises(EngineDeadError, match="the engine is asleep"):
        engine.check_health()
    assert executor.restarts == [] and executor.is_shut_down
