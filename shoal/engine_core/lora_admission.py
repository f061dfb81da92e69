"""`LoRAAdmission` (the scheduler inherits it): at most `max_loras` adapters run at once, since
the workers hold that many in GPU slots and a step's tokens index them.

The running requests' adapters never number more than `max_loras`, so no step does either. A
waiting request joins when it needs no adapter, an adapter already running, or a free slot;
otherwise it waits and the next waiting request that fits goes first.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from shoal.engine_core.request import Request


class LoRAAdmission:
    max_loras: int | None  # None: no adapters
    running: list[Request]
    waiting: deque[Request]

    if TYPE_CHECKING:  # (RemoteKVLoads's, after this class in the scheduler's bases)

        def _parked_requests(self) -> list[Request]: ...

    def _next_waiting(self) -> Request | None:
        """The first waiting request that may join the running ones (None: none may)."""
        if self.max_loras is None:
            return self.waiting[0]
        running = self.running_adapters()
        for request in self.waiting:
            if request.lora_name is None or request.lora_name in running or len(running) < self.max_loras:
                return request
        return None

    def running_adapters(self) -> set[str]:
        """The running requests' adapters, and those of the requests parked while their KV
        loads (remote_kv.py): they start without asking again."""
        return {r.lora_name for r in [*self.running, *self._parked_requests()] if r.lora_name is not None}

    def lora_stats(self) -> dict[str, Any]:
        """vLLM's `lora_requests_info`: the adapters running and waiting, and max_loras."""
        if self.max_loras is None:
            return {}
        waiting = {r.lora_name for r in self.waiting if r.lora_name is not None}
        return {
            "running_lora_adapters": sorted(self.running_adapters()),
            "waiting_lora_adapters": sorted(waiting),
            "max_loras": self.max_loras,
        }
