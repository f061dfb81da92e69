"""Requests parked while their KV loads in the background (shoal/engine_core/remote_kv.py),
driven by hand through a fake connector: the others step on, a loaded request starts with its
loaded tokens computed, a failed load ends its request and frees its blocks without leaving
them in the prefix cache, and an aborted or preempted one has its load cancelled while its
blocks are still held."""

from __future__ import annotations

from shoal.engine_core.request import Request, RequestStatus
from shoal.engine_core.scheduler import Scheduler
from tests.engine_core.test_scheduler import add, assert_all_free, make_request, make_scheduler, outputs_by_id, step

FAILED = "kv transfer failed: KVTransferTimeout: it never came"


class LoadsInTheBackground:
    """A connector that loads every prompt token but the last of the requests named in
    `remote`, in the background, and records the scheduler's calls."""

    def __init__(self, scheduler: Scheduler, remote: set[str]) -> None:
        self.scheduler = scheduler
        self.remote = remote
        self.loads: dict[str, tuple[list[int], int, int]] = {}
        # (request id, workers alive, its blocks still held when cancelled)
        self.cancelled: list[tuple[str, bool, bool]] = []
        scheduler.kv_connector = self

    def num_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if request.request_id not in self.remote or request.num_preemptions:
            return 0
        return request.num_prompt_tokens - 1 - num_computed_tokens

    def loads_in_background(self, request: Request) -> bool:
        return request.request_id in self.remote

    def load_into(self, request: Request, block_ids: list[int], num_computed_tokens: int, num_tokens: int) -> None:
        self.loads[request.request_id] = (list(block_ids), num_computed_tokens, num_tokens)

    def cancel_load(self, request: Request, workers_alive: bool = True) -> None:
        held = request.request_id in self.scheduler.kv_cache_manager.req_to_blocks
        self.cancelled.append((request.request_id, workers_alive, held))


def _num_hit_tokens(scheduler: Scheduler, prompt: list[int]) -> int:
    return scheduler.kv_cache_manager.get_computed_blocks(make_request("probe", prompt))[1]


def test_a_parked_request_waits_while_others_step_then_starts_with_its_kv_loaded() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    connector = LoadsInTheBackground(scheduler, remote={"b"})
    prompt = list(range(100, 114))  # 14 tokens
    add(scheduler, make_request("a", 5, max_tokens=20), make_request("b", prompt, max_tokens=3))
    sched_out, _ = step(scheduler)
    assert sched_out.num_scheduled_tokens == {"a": 5}  # "b" is parked, in no step
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.WAITING_FOR_KV and b.num_computed_tokens == 0
    block_ids, first, num_tokens = connector.loads["b"]
    assert (first, num_tokens) == (0, 13) and len(block_ids) == 4  # every block of its prompt
    assert scheduler.kv_cache_manager.get_block_ids("b") == block_ids
    assert _num_hit_tokens(scheduler, prompt) == 0  # its blocks hold no KV yet: no one finds them
    assert scheduler.make_stats().num_deferred_reqs == 1
    for _ in range(5):
        sched_out, _ = step(scheduler)
        assert sched_out.num_scheduled_tokens == {"a": 1}

    scheduler.end_kv_load(b, None)
    sched_out, _ = step(scheduler)
    [new] = sched_out.new_reqs
    assert (new.req_id, new.num_computed_tokens, new.block_ids) == ("b", 13, block_ids)
    assert sched_out.num_scheduled_tokens == {"a": 1, "b": 1}  # only its last prompt token
    assert _num_hit_tokens(scheduler, prompt) == 12  # its full blocks are in the prefix cache now
    while scheduler.requests:
        step(scheduler)
    assert_all_free(scheduler, 32)


def test_a_failed_load_ends_its_request_and_leaves_nothing_in_the_prefix_cache() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    LoadsInTheBackground(scheduler, remote={"b"})
    prompt = list(range(200, 214))
    add(scheduler, make_request("a", prompt[:9], max_tokens=1))  # leaves 2 blocks in the cache
    step(scheduler)
    add(scheduler, make_request("b", prompt, max_tokens=3))
    step(scheduler)
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.WAITING_FOR_KV and b.num_computed_tokens == 8  # its prefix hit
    cached_before = set(scheduler.kv_cache_manager.block_pool._cached)

    scheduler.end_kv_load(b, FAILED)
    assert b.status == RequestStatus.FINISHED_ABORTED and "b" not in scheduler.requests
    [output] = scheduler.take_outputs_outside_steps()
    assert (output.request_id, output.finish_reason, output.stop_reason) == ("b", "abort", FAILED)
    # The hit's blocks stay cached (they hold real KV); the blocks the load was to fill never were.
    assert set(scheduler.kv_cache_manager.block_pool._cached) == cached_before
    assert _num_hit_tokens(scheduler, prompt) == 8
    scheduler.end_kv_load(b, None)  # a late report of a request gone changes nothing
    assert_all_free(scheduler, 32)


def test_abort_of_a_parked_request_cancels_its_load_before_freeing_its_blocks() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    connector = LoadsInTheBackground(scheduler, remote={"b", "c"})
    add(scheduler, make_request("a", 6, max_tokens=4), make_request("b", 10), make_request("c", 10))
    step(scheduler)
    scheduler.end_kv_load(scheduler.requests["c"], None)  # "c" loaded, not started yet
    scheduler.abort_requests(["b", "c"])
    assert connector.cancelled == [("b", True, True)]  # "c" had nothing in flight to cancel
    assert not scheduler.loading_kv and not scheduler.kv_loaded
    outputs = {}
    while scheduler.requests:
        outputs |= outputs_by_id(step(scheduler)[1])
    assert list(outputs) == ["a"]
    assert_all_free(scheduler, 32)


def test_parked_requests_count_against_max_num_seqs() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=2)
    LoadsInTheBackground(scheduler, remote={"a", "b"})
    add(scheduler, make_request("a", 6), make_request("b", 6), make_request("c", 6))
    sched_out, _ = step(scheduler)
    assert sched_out.num_scheduled_tokens == {} and [r.request_id for r in scheduler.waiting] == ["c"]
    scheduler.end_kv_load(scheduler.requests["a"], None)
    sched_out, _ = step(scheduler)
    assert sched_out.num_scheduled_tokens == {"a": 1}  # "c" still waits: "b" holds the other seat


def test_a_sleep_or_a_worker_restart_preempts_parked_requests_to_recompute() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    connector = LoadsInTheBackground(scheduler, remote={"b", "c"})
    add(scheduler, make_request("a", 6, max_tokens=8), make_request("b", 10, max_tokens=2))
    step(scheduler)
    scheduler.sleep(discard_weights=False)
    assert connector.cancelled == [("b", True, True)]
    assert [(r.request_id, r.status) for r in scheduler.waiting] == [
        ("a", RequestStatus.PREEMPTED),
        ("b", RequestStatus.PREEMPTED),
    ]
    assert scheduler.kv_cache_manager.block_pool.num_used_blocks == 0
    scheduler.wake_up()
    add(scheduler, make_request("c", 10, max_tokens=2))
    sched_out, _ = step(scheduler)  # "b" recomputes its prompt; "c" is parked
    assert sched_out.num_scheduled_tokens == {"a": 7, "b": 10}  # ("a" with its first output token)
    assert scheduler.requeue_for_recompute() == 2
    assert connector.cancelled[-1] == ("c", False, True)  # the workers lost their state: nothing to ask
    assert [r.request_id for r in scheduler.waiting] == ["a", "b", "c"]
    while scheduler.requests:
        step(scheduler)
    assert_all_free(scheduler, 32)


def test_a_parked_requests_adapter_holds_its_slot() -> None:
    """It starts without asking for an adapter slot again, so no other adapter may take it."""
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    scheduler.max_loras = 1
    LoadsInTheBackground(scheduler, remote={"a"})
    a, b = make_request("a", 6), make_request("b", 6)
    a.lora_name, b.lora_name = "sql", "chat"
    add(scheduler, a, b)
    sched_out, _ = step(scheduler)
    assert sched_out.num_scheduled_tokens == {} and scheduler.running_adapters() == {"sql"}
    scheduler.end_kv_load(a, None)
    sched_out, _ = step(scheduler)
    assert sched_out.num_scheduled_tokens == {"a": 1}  # "chat" waits for "sql" to end
