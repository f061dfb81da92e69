"""Errors that cross shoal's layers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process or one of its workers died; the engine cannot serve any more.
    Every waiting client gets this error, and health checks fail from then on."""


class GenerationHeldError(RuntimeError):
    """A synchronous `LLM.generate` (or `chat`) was called while the engine holds new requests:
    asleep, paused, or with its weights discarded by `sleep(level=2)`. Nothing in the calling
    thread could end the hold, so the call fails instead of waiting forever (`AsyncLLM` and the
    server let such requests wait)."""
