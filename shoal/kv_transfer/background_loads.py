"""`BackgroundLoads`: a worker's KV transfers loading while its steps run (the decode side of
prefill/decode disaggregation).

The engine core parks a request whose KV comes from a prefill engine and has every worker start
its load (`Worker.start_kv_load`). Each load runs on a thread of its own, so that a transfer
that is slow or never comes holds back no other: it waits for the transfer (bounded by its
timeout) and copies it into the request's blocks. On GPU the copy runs on a side stream that
first waits for the work the compute stream had queued when the load started (a step still
running may write the blocks' previous owner's KV), and the thread synchronizes it before
reporting. The engine core collects which loads ended, and how (`Worker.ended_kv_loads`),
between steps, while any is in flight.

A load the engine gives up (its request aborted or preempted, or failed on another worker) is
cancelled (`Worker.cancel_kv_loads`): its `CopyGate` closes, and once `cancel` returns the load
writes nothing more, so its blocks may go to another request at once. A cancelled load's thread
still waits out its transfer, to release it, and reports nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import torch

# (load id, seconds it took, None or why it failed): what `take_ended` reports for each load.
EndedLoad = tuple[int, float, "str | None"]
# Waits for a transfer and copies it into blocks: (transfer id, first block of the transfer to
# copy, the blocks to copy into, timeout, the gate to copy through).
LoadFn = Callable[[str, int, list[int], float, "CopyGate"], None]


class CopyGate:
    """Whether a load may still write into its blocks; closed by a cancel, which waits for a
    copy under way to end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True

    @contextlib.contextmanager
    def open(self) -> Iterator[bool]:
        """Held for the whole copy: yields whether the copy may happen."""
        with self._lock:
            yield self._open

    def close(self) -> None:
        with self._lock:
            self._open = False


class BackgroundLoads:
    def __init__(self, load: LoadFn, device: torch.device) -> None:
        self._load = load
        self.device = device
        self._gates: dict[int, CopyGate] = {}  # loads in flight, by id
        self._ended: list[EndedLoad] = []
        self._changed = threading.Condition()

    def start(self, load_id: int, transfer_id: str, first_block: int, block_ids: list[int], timeout_s: float) -> None:
        gate = CopyGate()
        with self._changed:
            self._gates[load_id] = gate
        queued = None
        if self.device.type == "cuda":  # what the compute stream has queued so far comes before the copy
            queued = torch.cuda.Event()
            queued.record(torch.cuda.current_stream(self.device))
        threading.Thread(
            target=self._run,
            args=(load_id, (transfer_id, first_block, block_ids, timeout_s, gate), queued),
            name=f"shoal-kv-load-{load_id}",
            daemon=True,
        ).start()

    def _run(self, load_id: int, args: tuple, queued: torch.cuda.Event | None) -> None:
        start = time.perf_counter()
        error = None
        try:
            with self._side_stream(queued):
                self._load(*args)
        except Exception as exc:  # reported to the engine, which ends the request
            error = f"{type(exc).__name__}: {exc}"
        with self._changed:
            if self._gates.pop(load_id, None) is not None:  # (a cancelled load is not reported)
                self._ended.append((load_id, time.perf_counter() - start, error))
                self._changed.notify_all()

    @contextlib.contextmanager
    def _side_stream(self, queued: torch.cuda.Event | None) -> Iterator[None]:
        if queued is None:
            yield
            return
        torch.cuda.set_device(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_event(queued)
        with torch.cuda.stream(stream):
            yield

    def take_ended(self, wait_s: float = 0.0) -> list[EndedLoad]:
        """The loads that ended since the last call; with none yet and some in flight, waits
        up to `wait_s` for one."""
        with self._changed:
            if not self._ended and self._gates and wait_s > 0:
                self._changed.wait(wait_s)
            ended, self._ended = self._ended, []
        return ended

    def cancel(self, load_ids: list[int]) -> None:
        """Once this returns, none of these loads writes into its blocks any more."""
        for load_id in load_ids:
            with self._changed:
                gate = self._gates.pop(load_id, None)
            if gate is not None:
                gate.close()  # (outside the condition: a copy under way reports through it)

    @property
    def num_in_flight(self) -> int:
        return len(self._gates)
