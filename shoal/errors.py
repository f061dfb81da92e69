"""Errors that cross shoal's layers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core process or one of its workers died; the engine cannot serve any more.
    Every waiting client gets this error, and health checks fail from then on."""
