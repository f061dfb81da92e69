"""Errors that cross shoal's layers."""

from __future__ import annotations

from collections.abc import Iterable


class EngineDeadError(RuntimeError):
    """The engine core process or one of its workers died; the engine cannot serve any more.
    Every waiting client gets this error, and health checks fail from then on."""


class WorkerDiedError(EngineDeadError):
    """Worker actors died (or stopped answering) while the engine core process lives on. The
    engine core re-creates them and recomputes the running requests (see
    `EngineCore.recover_from_worker_death`) while `max_worker_restarts` allows; past it, or
    from any caller that cannot recover, it is the `EngineDeadError` it derives from."""

    def __init__(self, ranks: Iterable[int], message: str) -> None:
        super().__init__(message)
        self.ranks = tuple(sorted(set(ranks)))


class GenerationHeldError(RuntimeError):
    """A synchronous `LLM.generate` (or `chat`) was called while the engine holds new requests:
    asleep, paused, or with its weights discarded by `sleep(level=2)`. Nothing in the calling
    thread could end the hold, so the call fails instead of waiting forever (`AsyncLLM` and the
    server let such requests wait)."""


class RequestUnavailableError(RuntimeError):
    """One request could not be served, though the server lives on: with prefill/decode
    disaggregation, no engine could take it within the proxy's bounds (dead engines, failed KV
    transfers). HTTP 503; the client may retry."""
