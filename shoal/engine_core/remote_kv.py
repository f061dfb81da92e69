"""`RemoteKVLoads`: requests parked while their KV arrives from elsewhere in the background.

A decode engine of prefilled requests (prefill/decode disaggregation) loads each request's KV
from another engine. That transfer may be slow, or never come (a dead prefill engine), so it
must not hold the engine's other requests. The connector says such a load runs in the
background (`KVConnector.loads_in_background`); the scheduler then parks the request:

1. Admission allocates the request's blocks (its prefix hit, the tokens to load, the rest of
   its prompt) and has the connector start the load into them, but registers in the prefix
   cache only the hit's blocks: the others hold no KV yet, and no other request may find them.
   The request waits (`WAITING_FOR_KV`), in no step, counted against `max_num_seqs`.
2. The connector reports the load's end (`end_kv_load`). Loaded: its tokens count as computed
   from now on, and the request starts, before the waiting queue, in the next step with room
   (its loaded blocks join the prefix cache then). Failed or timed out: the request ends as
   aborted with the connector's reason (`kv transfer failed: ...`), its blocks simply freed.
3. A parked request given up (aborted, or preempted by a sleep, a pause or a worker restart)
   has its load cancelled first, so that nothing writes into its blocks once they are freed.
   A preempted one recomputes its prompt later (the connector loads nothing for it again).

`Scheduler` inherits this; the scheduler's loop calls `_park_for_kv` and `_schedule_loaded`.
Plain Python.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from shoal.engine_core.request import Request, RequestStatus
from shoal.protocol import EngineCoreOutput

if TYPE_CHECKING:
    from shoal.engine_core.block_pool import KVCacheBlock
    from shoal.engine_core.kv_cache_manager import KVCacheManager
    from shoal.engine_core.scheduled_step import ScheduledStep
    from shoal.kv_transfer.connector import KVConnector


class RemoteKVLoads:
    kv_connector: KVConnector | None
    kv_cache_manager: KVCacheManager
    running: list[Request]
    waiting: deque[Request]
    num_lookahead_slots: int
    _outputs_outside_steps: list[EngineCoreOutput]

    def _start(self, step: ScheduledStep, request: Request, num_computed_tokens: int, num_new_tokens: int) -> None: ...

    def _free_request(self, request: Request) -> None: ...

    def _init_remote_kv(self) -> None:
        # Parked requests whose load is in flight, by id, with how many tokens it brings.
        self.loading_kv: dict[str, tuple[Request, int]] = {}
        # Parked requests whose load ended well, in that order: they start before the waiting queue.
        self.kv_loaded: deque[Request] = deque()

    @property
    def num_parked(self) -> int:
        """Requests waiting for their KV (or, loaded, for room in a step): deferred, in the stats."""
        return len(self.loading_kv) + len(self.kv_loaded)

    def _loads_in_background(self, request: Request) -> bool:
        return self.kv_connector is not None and self.kv_connector.loads_in_background(request)

    def _load_with_step(self, request: Request, num_hit_tokens: int, num_loaded_tokens: int) -> None:
        """A load that is not in the background: its KV is copied in before the request's step."""
        assert self.kv_connector is not None
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        self.kv_connector.load_into(request, block_ids, num_hit_tokens, num_loaded_tokens)

    def _park_for_kv(
        self, request: Request, hit_blocks: list[KVCacheBlock], num_hit_tokens: int, num_loaded_tokens: int
    ) -> bool:
        """Allocate a waiting request's blocks, hand its load to the connector, and park it until the
        load ends; False (nothing changed) when its blocks do not fit."""
        assert self.kv_connector is not None
        num_slots = request.num_tokens - num_hit_tokens + self.num_lookahead_slots
        manager = self.kv_cache_manager
        if manager.allocate_slots(request, num_slots, hit_blocks, num_hit_tokens, cache_up_to=num_hit_tokens) is None:
            return False
        self.waiting.remove(request)
        request.status = RequestStatus.WAITING_FOR_KV
        request.num_computed_tokens = num_hit_tokens  # the loaded tokens count once they are in
        self.loading_kv[request.request_id] = (request, num_loaded_tokens)
        self.kv_connector.load_into(
            request, manager.get_block_ids(request.request_id), num_hit_tokens, num_loaded_tokens
        )
        return True

    def end_kv_load(self, request: Request, failure: str | None) -> None:
        """The connector's report: the request's load ended, well (`failure` None) or not (the
        stop reason to end the request with). A request no longer parked is ignored."""
        parked = self.loading_kv.get(request.request_id)
        if parked is None or parked[0] is not request:
            return
        del self.loading_kv[request.request_id]
        if failure is None:
            request.num_computed_tokens += parked[1]
            self.kv_loaded.append(request)
            return
        request.status, request.stop_reason = RequestStatus.FINISHED_ABORTED, failure
        self._free_request(request)  # none of its loaded blocks is in the prefix cache
        self._outputs_outside_steps.append(
            EngineCoreOutput(request.request_id, [], finish_reason="abort", stop_reason=failure)
        )

    def _schedule_loaded(self, step: ScheduledStep) -> None:
        """Loaded requests start, in the order their loads ended, while the budget allows; their
        blocks were allocated when they were parked (this allocation registers them)."""
        while self.kv_loaded and step.budget > 0:
            request = self.kv_loaded[0]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, step.budget)
            if self.kv_cache_manager.allocate_slots(request, num_new_tokens + self.num_lookahead_slots) is None:
                return
            self.kv_loaded.popleft()
            self._start(step, request, request.num_computed_tokens, num_new_tokens)

    def _unpark(self, request: Request, workers_alive: bool = True) -> None:
        """Take a parked request out (it is aborted or preempted); a load still in flight is
        cancelled before its blocks can be freed."""
        if self.loading_kv.pop(request.request_id, None) is None:
            self.kv_loaded.remove(request)
        elif self.kv_connector is not None:
            self.kv_connector.cancel_load(request, workers_alive)

    def _parked_requests(self) -> list[Request]:
        return [request for request, _ in self.loading_kv.values()] + list(self.kv_loaded)
