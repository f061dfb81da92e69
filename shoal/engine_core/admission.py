"""What the scheduler may schedule (`Admission`), the weight version every step runs with, and
the requeue of every running request after a worker's death: the scheduler's side of the engine
core's control calls, made between steps.

Scheduling can be held: by a pause (`pause`, as `EngineCore.pause_generation` asks), while the
engine sleeps, and while weights discarded by a level-2 sleep (or half written by an update in
several calls) have not been replaced. A "wait" pause lets the requests already started run to
their end and admits no new one; the other holds schedule nothing. Requests that arrive
meanwhile wait. Every step is stamped with the weight version it runs with (`weight_version`),
which its outputs carry to the frontend.

`Scheduler` inherits `AdmissionControl`; the scheduler's loop only reads `admission`.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from shoal.engine_core.kv_cache_manager import KVCacheManager
from shoal.engine_core.request import Request, RequestStatus
from shoal.protocol import EngineCoreOutput

if TYPE_CHECKING:
    from shoal.engine_core.scheduled_step import ScheduledStep

PAUSE_MODES = ("abort", "wait", "keep")


class Admission(enum.Enum):
    """What `Scheduler.schedule` may schedule."""

    OPEN = "open"  # every request
    DRAIN = "drain"  # only requests already started (a "wait" pause)
    HOLD = "hold"  # nothing (paused, asleep, or weights discarded)


class AdmissionControl:
    """The scheduler's pause, sleep and weight-version state.

    The engine core lands every step still in flight before it calls these (except a "wait"
    pause, whose requests go on running), so no request is in flight here.
    """

    requests: dict[str, Request]
    running: list[Request]
    waiting: deque[Request]
    kv_cache_manager: KVCacheManager
    async_scheduling: bool
    _scheduled: dict[int, ScheduledStep]
    _finished_req_ids: list[str]

    def abort_requests(self, request_ids: Iterable[str]) -> None: ...

    def _preempt(self, request: Request) -> None: ...

    if TYPE_CHECKING:  # (RemoteKVLoads's, after this class in the scheduler's bases)

        def _parked_requests(self) -> list[Request]: ...

        def _unpark(self, request: Request, workers_alive: bool = True) -> None: ...

    def _init_admission(self) -> None:
        # The version of the weights that steps scheduled from now on run with: "0" at start,
        # advanced by every weight update (see `advance_weight_version`).
        self.weight_version = "0"
        self._num_weight_updates = 0
        # Why scheduling is held, if it is (see `_update_admission`).
        self.pause_mode: str | None = None
        self.sleeping = False
        self.weights_missing = False  # discarded by a level-2 sleep (or half updated), not yet replaced
        self.admission = Admission.OPEN

    def has_work(self) -> bool:
        """Whether `schedule` may have something to run: any request while admission is open;
        under a "wait" pause only requests already started (running, or preempted: those wait
        at the front of the queue); nothing while held."""
        if self.admission is Admission.OPEN:
            return bool(self.requests)
        return self.admission is Admission.DRAIN and self.has_started_requests()

    def has_schedulable_requests(self) -> bool:
        """Whether `schedule` may build a step now: `has_work`, and a request not in flight
        (with async scheduling, requests in flight may run ahead)."""
        if self.admission is not Admission.OPEN and not self.has_work():
            return False
        if self.async_scheduling:
            return bool(self.requests)
        return any(not request.num_steps_in_flight for request in self.requests.values())

    def has_started_requests(self) -> bool:
        """Whether a request that has started generating is unfinished: running, parked while
        its KV loads (remote_kv.py), or preempted (preempted requests wait at the front of the
        queue)."""
        if self.running or self._parked_requests():
            return True
        return bool(self.waiting and self.waiting[0].status == RequestStatus.PREEMPTED)

    # ---- weight versions ----------------------------------------------------------------------

    @property
    def weights_updated_in_place(self) -> bool:
        """Whether weights were updated since they were loaded (a re-created worker, which
        loads the checkpoint, would not run them)."""
        return self._num_weight_updates > 0

    def advance_weight_version(self, name: str | None = None) -> str:
        """New weights are in: later steps run with version `name`, or by default with the
        number of updates so far ("1", "2", ...). Returns the new version. Weights discarded by a
        level-2 sleep count as replaced from now on."""
        self._num_weight_updates += 1
        self.weight_version = str(self._num_weight_updates) if name is None else name
        if self.weights_missing:
            self.weights_missing = False
            self._update_admission()
        return self.weight_version

    def hold_for_weight_update(self) -> None:
        """An update in several calls has begun: hold scheduling until its last call (which
        advances the weight version), so that no step runs with half-written weights."""
        self.weights_missing = True
        self._update_admission()

    # ---- pause and sleep ----------------------------------------------------------------------

    def pause(self, mode: str, clear_cache: bool = True) -> list[EngineCoreOutput]:
        """Hold scheduling until `resume`. "abort" finishes every request (running and waiting)
        as aborted and returns their final outputs; "wait" lets the requests already started
        run to their end; "keep" freezes them. With `clear_cache` the prefix cache is reset, and
        kept requests give up their KV cache (recomputed after `resume`, with the weights in
        place then)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        outputs = self._abort_all() if mode == "abort" else []
        if mode == "keep" and clear_cache:
            self.preempt_all_running()
        if clear_cache:
            self.kv_cache_manager.reset_prefix_cache()
        self.pause_mode = mode
        self._update_admission()
        return outputs

    def resume(self) -> None:
        self.pause_mode = None
        self._update_admission()

    def sleep(self, discard_weights: bool) -> None:
        """The workers are about to drop the KV cache (and with `discard_weights` the weights):
        running requests give up their blocks and wait to be recomputed after the wake-up, and
        the prefix cache forgets every block. Scheduling is held until `wake_up` (and, with
        `discard_weights`, until `advance_weight_version`)."""
        self.preempt_all_running()
        self.kv_cache_manager.reset_prefix_cache()
        self.sleeping = True
        self.weights_missing = self.weights_missing or discard_weights
        self._update_admission()

    def wake_up(self) -> None:
        self.sleeping = False
        self._update_admission()

    def preempt_all_running(self, workers_alive: bool = True) -> None:
        """Every running request gives up its KV blocks and waits, in its order, at the front
        of the queue, to be recomputed with its tokens so far; so does every request parked
        while its KV loads, after them (its load cancelled, unless the workers lost their state
        anyway: `workers_alive=False`)."""
        if any(request.num_steps_in_flight for request in self.running):
            raise RuntimeError("requests still in flight cannot give up their blocks: land their steps first")
        for request in reversed(self._parked_requests()):
            self._unpark(request, workers_alive)
            self._preempt(request)
        for request in reversed(self.running):
            self._preempt(request)
        self.running = []

    def _abort_all(self) -> list[EngineCoreOutput]:
        """Abort every request; their final outputs (no new tokens, finish_reason "abort")."""
        outputs = [
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason="abort",
                num_cached_tokens=max(request.num_cached_tokens, 0),
                first_scheduled_time=request.first_scheduled_time,
            )
            for request in self.requests.values()
        ]
        self.abort_requests(list(self.requests))
        return outputs

    # ---- a worker's death ----------------------------------------------------------------------

    def requeue_for_recompute(self) -> int:
        """The workers lost their state (one was re-created; every rank starts over with an
        empty batch and a KV cache of unknown content): forget the steps in flight, whose output
        will never come, and preempt every running request by recompute. Output tokens already
        sampled stay; a requeued request computes its prompt and them again, then samples the
        next. Returns how many requests were requeued."""
        for step in self._scheduled.values():
            for request in step.requests.values():
                request.num_steps_in_flight -= 1
        self._scheduled.clear()
        num_requeued = len(self.running)
        self.preempt_all_running(workers_alive=False)  # (which drops their placeholders too)
        # No worker knows any request now; there is nothing to tell them about finished ones.
        self._finished_req_ids.clear()
        self.kv_cache_manager.reset_prefix_cache()
        return num_requeued

    def _update_admission(self) -> None:
        if self.sleeping or self.weights_missing or self.pause_mode in ("abort", "keep"):
            self.admission = Admission.HOLD
        elif self.pause_mode == "wait":
            self.admission = Admission.DRAIN
        else:
            self.admission = Admission.OPEN
