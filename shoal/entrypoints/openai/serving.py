"""What the completion and chat handlers share: the model check, tokenization off the event
loop, the context-length check, server-sent events, merging the streams of several prompts,
and cancelling work when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Send

from shoal.entrypoints.openai.errors import bad_request, model_not_found, to_api_error
from shoal.entrypoints.openai.protocol import UsageInfo
from shoal.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shoal.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

T = TypeVar("T")
# A logprob of -inf has no JSON form; OpenAI clients expect a number.
MIN_LOGPROB = -9999.0
SSE_DONE = "data: [DONE]\n\n"


class OpenAIServing:
    """The engine, the served model's limits, and a thread that owns the tokenizer (encoding a
    long prompt or rendering a chat template must not stall every stream on the event loop)."""

    def __init__(self, engine: AsyncLLM, tokenizer_thread: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.config.model_config
        self.model_name = self.model_config.served_model_name
        self.max_model_len = self.model_config.max_model_len
        self._tokenizer_thread = tokenizer_thread

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise model_not_found(name)

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def check_prompt(self, prompt_token_ids: list[int], max_tokens: int | None, prompt_name: str) -> None:
        """A 400 unless the prompt and `max_tokens` new tokens fit in the context (OpenAI's wording)."""
        num_prompt_tokens = len(prompt_token_ids)
        param = "messages" if prompt_name == "messages" else "prompt"
        if max_tokens is not None and max_tokens >= 1 and num_prompt_tokens + max_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_name}, "
                f"{max_tokens} in the completion). Please reduce the length of the {prompt_name} or completion.",
                param,
            )
        if num_prompt_tokens >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your {prompt_name} "
                f"resulted in {num_prompt_tokens} tokens, which leaves no room for the completion. "
                f"Please reduce the length of the {prompt_name}.",
                param,
            )
        self.engine.input_processor.validate_prompt(prompt_token_ids)

    async def check_params(self, params: SamplingParams) -> None:
        """What only the model can tell about the sampling parameters (logit_bias ids in its
        vocabulary, a structured-output spec that compiles), checked in the tokenizer thread:
        a large schema must not stall the event loop. Raises `ValueError` (a 400)."""
        await self.in_tokenizer_thread(self.engine.input_processor.validate_params, params)

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then `data: [DONE]`; an error after the stream began becomes an error event
    (the status line is already sent), which the openai client raises as an `APIError`."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        yield sse_event(to_api_error(exc).body())
    finally:
        await _aclose(events)
    yield SSE_DONE


class SSEResponse(StreamingResponse):
    """Server-sent events. When the client disconnects, Starlette cancels the stream; closing the
    generator here (shielded from that cancellation) makes sure the engine aborts the request
    even when the cancellation lands outside the engine's own await."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await _aclose(self._events)


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with the stream's index. The first error
    ends the merge; leaving it early (or being cancelled) closes every stream."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await _aclose(streams[0])
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    finished = object()

    async def drain(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item, None))
            queue.put_nowait((index, finished, None))
        except Exception as exc:
            queue.put_nowait((index, None, exc))
        finally:
            await _aclose(stream)

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        num_open = len(tasks)
        while num_open:
            index, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is finished:
                num_open -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Run `work` (a non-streaming request) unless the client disconnects first; then cancel it
    (the engine aborts its requests) and return an empty 499 that nobody will read."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work_task.cancel()
        watch_task.cancel()
        raise
    watch_task.cancel()
    if work_task.done():
        return work_task.result()
    work_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work_task
    logger.info("Client disconnected; its request was aborted")
    return Response(status_code=499)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
