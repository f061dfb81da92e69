"""A worker's loads in the background (shoal/kv_transfer/background_loads.py) over the shared
memory transport: loads run side by side (a missing transfer holds back no other), each ends
once with its time or its error, and a cancelled load writes nothing, reports nothing, and
still releases its transfer when it arrives."""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from shoal.kv_transfer.background_loads import BackgroundLoads, CopyGate
from shoal.kv_transfer.shm_transport import SharedMemoryTransport
from shoal.kv_transfer.transport import load_blocks, save_blocks
from tests.kv_transfer.test_transports import LAYOUT, _caches


def _loads(transport: SharedMemoryTransport, target: list[torch.Tensor]) -> BackgroundLoads:
    def load(transfer_id: str, first_block: int, block_ids: list[int], timeout_s: float, gate: CopyGate) -> None:
        load_blocks(transport, transfer_id, LAYOUT, target, first_block, block_ids, timeout_s, gate)

    return BackgroundLoads(load, target[0].device)


def _wait_for(loads: BackgroundLoads, num: int, timeout_s: float = 5.0) -> list:
    ended: list = []
    deadline = time.monotonic() + timeout_s
    while len(ended) < num and time.monotonic() < deadline:
        ended += loads.take_ended(wait_s=0.05)
    return ended


def test_loads_run_side_by_side_and_each_reports_once(tmp_path: Path) -> None:
    transport = SharedMemoryTransport(str(tmp_path))
    source, target = _caches(6), _caches(8)
    loads = _loads(transport, target)
    start = partial(loads.start, first_block=0, block_ids=[3, 5])
    start(1, "never-saved", timeout_s=0.5)
    start(2, "saved-later", timeout_s=5.0)
    save_blocks(transport, "saved-later", LAYOUT, source, [4, 1])
    [(load_id, seconds, error)] = _wait_for(loads, 1, timeout_s=0.4)  # well before the other's timeout
    assert (load_id, error) == (2, None) and seconds < 0.4
    for src, dst in zip(source, target, strict=True):
        assert torch.equal(dst[:, 3], src[:, 4]) and torch.equal(dst[:, 5], src[:, 1])
    [(load_id, seconds, error)] = _wait_for(loads, 1)
    assert load_id == 1 and error.startswith("KVTransferTimeout") and 0.5 <= seconds < 2.0
    assert loads.take_ended() == [] and loads.num_in_flight == 0
    assert not list(tmp_path.iterdir())


def test_a_cancelled_load_writes_nothing_and_still_releases_its_transfer(tmp_path: Path) -> None:
    transport = SharedMemoryTransport(str(tmp_path))
    target = _caches(8)
    before = [cache.clone() for cache in target]
    loads = _loads(transport, target)
    loads.start(7, "late", first_block=0, block_ids=[0, 1], timeout_s=5.0)
    loads.cancel([7])
    assert loads.num_in_flight == 0
    save_blocks(transport, "late", LAYOUT, _caches(2), [0, 1])  # arrives after the cancel
    deadline = time.monotonic() + 5.0
    while list(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not list(tmp_path.iterdir())  # the load's thread found it and released it
    assert loads.take_ended(wait_s=0.1) == []
    assert all(torch.equal(a, b) for a, b in zip(target, before, strict=True))


def test_closing_the_gate_waits_for_a_copy_under_way() -> None:
    gate, copying, copied = CopyGate(), threading.Event(), []

    def copy() -> None:
        with gate.open() as may_copy:
            copying.set()
            time.sleep(0.1)
            copied.append(may_copy)

    threading.Thread(target=copy).start()
    copying.wait(5.0)
    gate.close()
    assert copied == [True]  # close returned only once the copy was over
    with gate.open() as may_copy:
        assert not may_copy


@pytest.mark.gpu
def test_a_load_into_a_device_cache_copies_on_a_side_stream_after_the_queued_work(tmp_path: Path) -> None:
    """The copy waits for what the compute stream had queued when the load started (here: a
    write into the same block, which the loaded KV must overwrite)."""
    transport = SharedMemoryTransport(str(tmp_path))
    source, target = _caches(4), _caches(4, "cuda")
    loads = _loads(transport, target)
    torch.cuda.set_device(0)
    torch.cuda._sleep(50_000_000)  # (tens of ms of queued work on the compute stream)
    for cache in target:
        cache[:, 2].fill_(7.0)
    save_blocks(transport, "on-gpu", LAYOUT, source, [1])
    loads.start(1, "on-gpu", first_block=0, block_ids=[2], timeout_s=5.0)
    [(load_id, _, error)] = _wait_for(loads, 1)
    assert (load_id, error) == (1, None)
    for src, dst in zip(source, target, strict=True):
        assert torch.equal(dst[:, 2].cpu(), src[:, 1])
