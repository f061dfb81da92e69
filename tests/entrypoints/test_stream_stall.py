"""`--stream-stall-timeout`: a streaming client that stops reading makes a send wait; after the
timeout the stream ends, its event generator is closed (which aborts the request in the
engine) and its admission is given back, while the event loop goes on serving everyone else.

Driven at the ASGI level, with a `send` that blocks as a full socket does: end to end, the
kernel's socket buffers (up to 4 MiB on Linux loopback) swallow a whole tiny-model response
before any send would wait."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from shoal.entrypoints.openai.serving import SSEResponse
from shoal.entrypoints.openai.serving_limits import Admission

STALL_TIMEOUT_S = 0.2
SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "asgi": {"spec_version": "2.4"}}


async def _stalled_stream() -> tuple[float, list[dict], bool, int, int]:
    """(seconds until the response returned, what was sent, whether the generator was closed,
    the admission's count after, ticks of another task meanwhile)."""
    closed = asyncio.Event()

    async def events() -> AsyncIterator[str]:
        try:
            for i in range(10**6):  # a request that would go on for a long time
                yield f'data: {{"i": {i}}}\n\n'
                await asyncio.sleep(0)
        finally:
            closed.set()  # what aborts the request in the engine (serving.py's event streams)

    admission = Admission(max_num_running=8, max_num_waiting=8)
    response = SSEResponse(events(), admission.admit(3), STALL_TIMEOUT_S)
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) >= 3:  # the headers and two events went out; then the client reads no more
            await asyncio.Event().wait()

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client stays connected
        return {"type": "http.disconnect"}

    ticks = 0

    async def neighbour() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    other = asyncio.ensure_future(neighbour())
    start = time.monotonic()
    await asyncio.wait_for(response(SCOPE, receive, send), timeout=10)
    elapsed = time.monotonic() - start
    other.cancel()
    return elapsed, sent, closed.is_set(), admission.num_seqs, ticks


def test_a_stream_whose_client_stops_reading_is_ended_and_aborted() -> None:
    elapsed, sent, closed, num_seqs, ticks = asyncio.run(_stalled_stream())
    assert STALL_TIMEOUT_S <= elapsed < STALL_TIMEOUT_S + 2
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert len(sent) == 3  # nothing more was pushed at the stalled client
    assert closed  # the generator was closed: the engine aborts the request
    assert num_seqs == 0  # its admission was given back
    assert ticks >= 3  # the event loop served others while the send waited (~20 ticks unloaded)
