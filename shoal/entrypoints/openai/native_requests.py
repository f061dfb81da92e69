"""The requests of the native generate routes (SGLang's /generate, vLLM's
/inference/v1/generate) in flight, by the id their client gave, so that an abort route can end
one with what it has generated; and `abort_all`, the abort of every request in the engine.

An abort of one request is answered like SGLang's: the request's response (or its stream) ends
at once with the tokens it has and finish_reason "abort". Aborting every request goes through
the engine (a pause that aborts, then a resume unless generation was paused already), so it
reaches the OpenAI routes' requests too, and each ends with the tokens it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request

if TYPE_CHECKING:
    from shoal.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

T = TypeVar("T")


class NativeRequests:
    """In-flight native requests: client id → the events that abort them."""

    def __init__(self) -> None:
        self._aborts: dict[str, list[asyncio.Event]] = {}

    @contextlib.contextmanager
    def track(self, request_id: str) -> Iterator[asyncio.Event]:
        """An event set when `request_id` is aborted, while the block runs."""
        event = asyncio.Event()
        self._aborts.setdefault(request_id, []).append(event)
        try:
            yield event
        finally:
            events = self._aborts.get(request_id, [])
            if event in events:
                events.remove(event)
            if not events:
                self._aborts.pop(request_id, None)

    def abort(self, request_ids: list[str]) -> int:
        """Abort these requests; returns how many were in flight."""
        found = 0
        for request_id in request_ids:
            for event in self._aborts.get(request_id, []):
                event.set()
                found += 1
        return found

    def abort_everything(self) -> None:
        for events in self._aborts.values():
            for event in events:
                event.set()

    def __len__(self) -> int:
        return sum(len(events) for events in self._aborts.values())


def native_requests(request: Request) -> NativeRequests:
    """The app's registry (made on first use)."""
    state = request.app.state
    if not hasattr(state, "native_requests"):
        state.native_requests = NativeRequests()
    return state.native_requests


async def abort_all(engine: AsyncLLM) -> None:
    """Abort every request in the engine: each ends now with the tokens it has. Generation stays
    paused if it was."""
    was_paused = await engine.is_paused()
    await engine.pause_generation(mode="abort", clear_cache=False)
    if not was_paused:
        await engine.resume_generation()
    logger.info("every request was aborted")


async def until_aborted(outputs: AsyncIterator[T], aborted: asyncio.Event) -> AsyncIterator[T]:
    """The outputs, until the last or until `aborted` is set; then the generator is closed
    (which aborts its request in the engine)."""
    try:
        while True:
            next_output = asyncio.ensure_future(outputs.__anext__())
            abort_wait = asyncio.ensure_future(aborted.wait())
            await asyncio.wait({next_output, abort_wait}, return_when=asyncio.FIRST_COMPLETED)
            abort_wait.cancel()
            if not next_output.done():
                next_output.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await next_output
                return
            try:
                yield next_output.result()
            except StopAsyncIteration:
                return
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
