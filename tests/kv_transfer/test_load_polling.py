"""The decode side of `PDConnector` (shoal/kv_transfer/pd_connector.py) over two stand-in
workers: a load ends when every worker finished it, fails (cancelled everywhere) when one
worker failed it or none finished it by its deadline, and the host tier's copies of a step
that starts loads are made before them."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.engine_core.request import RequestStatus
from shoal.kv_transfer import pd_connector
from shoal.kv_transfer.params import KV_TRANSFER_FAILED, KVTransferParams
from shoal.kv_transfer.pd_connector import PDConnector
from shoal.step import KVBlockCopies
from tests.engine_core.test_scheduler import add, make_request, make_scheduler

NUM_RANKS = 2


class TwoWorkers:
    """Records the connector's calls; `ended[rank]` is what that worker reports at the next poll."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.ended: list[list[tuple[int, float, str | None]]] = [[] for _ in range(NUM_RANKS)]

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Any = None, timeout: Any = None) -> list[Any]:
        self.calls.append((method, args))
        if method == "ended_kv_loads":
            ended, self.ended = self.ended, [[] for _ in range(NUM_RANKS)]
            return ended
        return [None] * NUM_RANKS


def _setup(*timeouts_s: float) -> tuple[Any, PDConnector, TwoWorkers, list[int]]:
    """A scheduler with one parked request per timeout (ids r0, r1, ...), their loads started."""
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    workers = TwoWorkers()
    connector = PDConnector(workers, scheduler, block_size=4, inner=None)  # type: ignore[arg-type]
    scheduler.kv_connector = connector
    for i, timeout_s in enumerate(timeouts_s):
        load = KVTransferParams(transfer_id=f"t{i}", role="load", num_tokens=9, timeout_s=timeout_s)
        add(scheduler, make_request(f"r{i}", 10, extra_args=load.as_extra_args()))
    assert scheduler.schedule().num_scheduled_tokens == {}
    connector.start_loads()
    load_ids = [args[0] for method, args in workers.calls if method == "start_kv_load"]
    assert [args[1:] for method, args in workers.calls] == [
        (f"t{i}", 0, scheduler.kv_cache_manager.get_block_ids(f"r{i}")[:3], t) for i, t in enumerate(timeouts_s)
    ]
    return scheduler, connector, workers, load_ids


def test_a_load_ends_when_every_worker_finished_it() -> None:
    scheduler, connector, workers, [load_id] = _setup(10.0)
    workers.ended[0] = [(load_id, 0.5, None)]
    connector.poll_loads()
    assert scheduler.requests["r0"].status == RequestStatus.WAITING_FOR_KV and connector.num_loading == 1
    workers.ended[1] = [(load_id, 0.75, None)]
    connector.poll_loads()
    assert list(scheduler.kv_loaded) == [scheduler.requests["r0"]] and connector.num_loading == 0
    stats = connector.stats_dict()
    assert stats["kv_transfer_loaded"] == 1 and stats["kv_transfer_tokens_loaded"] == 9
    assert stats["kv_transfer_seconds"] == 0.75
    assert scheduler.schedule().num_scheduled_tokens == {"r0": 1}
    num_calls = len(workers.calls)
    connector.poll_loads()  # nothing in flight: the workers are not asked
    assert len(workers.calls) == num_calls


def test_a_load_one_worker_failed_is_cancelled_on_all_and_ends_its_request() -> None:
    scheduler, connector, workers, [load_id] = _setup(10.0)
    workers.ended = [[(load_id, 0.1, None)], [(load_id, 0.1, "KVTransferError: layouts differ")]]
    connector.poll_loads()
    assert workers.calls[-1] == ("cancel_kv_loads", ([load_id],))
    [output] = scheduler.take_outputs_outside_steps()
    assert output.finish_reason == "abort"
    assert output.stop_reason == f"{KV_TRANSFER_FAILED}: KVTransferError: layouts differ"
    assert not scheduler.requests and scheduler.kv_cache_manager.block_pool.num_used_blocks == 0
    assert connector.stats_dict()["kv_transfer_failed"] == 1 and connector.num_loading == 0


def test_a_load_no_worker_finished_by_its_deadline_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pd_connector, "_RPC_MARGIN_S", 0.0)
    scheduler, connector, workers, [stuck, _] = _setup(0.0, 10.0)
    connector.poll_loads()
    assert ("cancel_kv_loads", ([stuck],)) in workers.calls
    [output] = scheduler.take_outputs_outside_steps()
    assert output.request_id == "r0" and "no worker finished it within 0 s" in str(output.stop_reason)
    assert list(scheduler.loading_kv) == ["r1"]
    workers.ended = [[(stuck, 0.1, None)], [(stuck, 0.1, None)]]  # too late: ignored
    connector.poll_loads()
    assert list(scheduler.loading_kv) == ["r1"] and not scheduler.kv_loaded


def test_the_host_tiers_copies_go_before_loads_start() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    workers = TwoWorkers()
    connector = PDConnector(workers, scheduler, block_size=4, inner=None)  # type: ignore[arg-type]
    copies = KVBlockCopies([3], [0], [], [])
    assert connector.flush_block_copies(copies) is copies  # no load to start: they go with the step
    scheduler.kv_connector = connector
    load = KVTransferParams(transfer_id="t", role="load", num_tokens=9)
    add(scheduler, make_request("r", 10, extra_args=load.as_extra_args()))
    scheduler.schedule()
    assert connector.flush_block_copies(copies) is None
    connector.start_loads()
    assert [method for method, _ in workers.calls] == ["copy_kv_blocks", "start_kv_load"]
