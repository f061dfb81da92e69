"""`EngineCoreClient`: how the frontend reaches the engine core.

`InprocClient` holds the core in this process and steps it on demand (tests, the simplest
offline use). The multiprocess clients talk to a core in its own process over ZeroMQ.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from shoal.config import EngineConfig
from shoal.protocol import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (blocks until the core has some)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Call an `EngineCore` method (collective_rpc, reset_prefix_cache, get_stats, ...)."""

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        from shoal.engine_core.engine_core import EngineCore

        self.core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.core, method)(*args)

    def shutdown(self) -> None:
        self.core.shutdown()
