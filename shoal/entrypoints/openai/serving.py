"""What the completion and chat handlers share: the model check, tokenization off the event
loop, prompt truncation and the context-length check, the overload limits (`serving_limits.py`),
the fields both routes answer alike (token names, prompt logprobs, response ids), server-sent
events, merging the streams of several prompts, and cancelling work when the client goes away."""

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
from shoal.entrypoints.openai.protocol import PromptLogprob, PromptLogprobs, SamplingRequest, UsageInfo, random_id
from shoal.entrypoints.openai.serving_limits import (
    Admission,
    KVCacheFit,
    ServingLimits,
    Ticket,
    default_max_num_waiting,
    with_deadline,
)
from shoal.frontend.beam_search import top_completions
from shoal.frontend.output_processor import OutputKind
from shoal.outputs import PositionLogprobs, RequestOutput
from shoal.sampling_params import BeamSearchParams, SamplingParams

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

    def __init__(
        self,
        engine: AsyncLLM,
        tokenizer_thread: ThreadPoolExecutor,
        limits: ServingLimits | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.config.model_config
        self.model_name = self.model_config.served_model_name
        self.max_model_len = self.model_config.max_model_len
        self._tokenizer_thread = tokenizer_thread
        self.limits = limits or ServingLimits()
        num_kv_blocks = getattr(engine.engine_core, "num_kv_blocks", None)
        self.kv_cache_fit = KVCacheFit(num_kv_blocks, engine.config.cache_config.block_size)
        self.admission = admission or make_admission(engine, self.limits)

    def admit(self, num_seqs: int) -> Ticket:
        """Hold `num_seqs` sequences until the response ends (a 429 past the waiting limit)."""
        return self.admission.admit(num_seqs)

    def deadline(self) -> float | None:
        """The event-loop time by which a request arriving now must finish (`--request-timeout`)."""
        timeout_s = self.limits.request_timeout_s
        return None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s

    def bounded(self, stream: AsyncIterator[T], deadline: float | None) -> AsyncIterator[T]:
        """`stream`, aborted with a 503 once `deadline` passes."""
        if deadline is None:
            return stream
        assert self.limits.request_timeout_s is not None
        return with_deadline(stream, deadline, self.limits.request_timeout_s)

    def sse_response(self, events: AsyncIterator[str], ticket: Ticket) -> SSEResponse:
        return SSEResponse(sse_stream(events), ticket, self.limits.stream_stall_timeout_s)

    async def until_done(self, raw_request: Request, work: Awaitable[T], ticket: Ticket) -> T | Response:
        """`until_disconnected`, the ticket given back at the end."""
        try:
            return await until_disconnected(raw_request, work)
        finally:
            ticket.release()

    def check_model(self, name: str | None) -> None:
        """The served model's name, or one of its LoRA adapters' (a 404 otherwise)."""
        if name is not None and name != self.model_name and name not in self.engine.lora_adapters.loaded:
            raise model_not_found(name)

    def response_model(self, name: str | None) -> str:
        """The `model` a response names: the request's LoRA adapter, else the served model."""
        return name if name is not None and name in self.engine.lora_adapters.loaded else self.model_name

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def truncated(self, token_ids: list[int], request: SamplingRequest, max_tokens: int | None) -> list[int]:
        """The prompt's tokens after vLLM's `truncate_prompt_tokens`: the last N ("left", the
        default `truncation_side`) or the first N ("right"); -1 keeps as many as fit in the
        context with `max_tokens` (at least one) new tokens."""
        keep = request.truncate_prompt_tokens
        if keep is None:
            return token_ids
        if keep == -1:
            keep = max(self.max_model_len - max(max_tokens or 1, 1), 1)
        if len(token_ids) <= keep:
            return token_ids
        return token_ids[:keep] if request.truncation_side == "right" else token_ids[-keep:]

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

    def token_name(self, token_id: int, decoded: str | None, as_token_ids: bool | None) -> str:
        """How logprobs name a token: its text, or "token_id:<id>" (vLLM's
        `return_tokens_as_token_ids`, for tokens whose text is not valid on its own)."""
        if as_token_ids:
            return f"token_id:{token_id}"
        return decoded if decoded is not None else self.decode_token(token_id)

    def generate(
        self,
        prompt: dict[str, Any],
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        kind: OutputKind,
        n: int,
        num_logprobs: int | None,
        model: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one prompt: sampled, or (`BeamSearchParams`) the best `n`
        beams in one output, with `num_logprobs` logprobs per position. A `model` naming a LoRA
        adapter runs it with the adapter."""
        lora_request = self.engine.lora_adapters.loaded.get(model) if model is not None else None
        if isinstance(params, SamplingParams):
            return self.engine.generate(prompt, params, request_id, output_kind=kind, lora_request=lora_request)
        if lora_request is not None:
            raise bad_request("beam search with a LoRA adapter is not supported", "model")
        return _best_beams(self.engine.beam_search(prompt, request_id, params), n, num_logprobs)


def check_stream_fields(request: SamplingRequest) -> None:
    """The fields that need (or refuse) `stream: true`, as OpenAI and vLLM answer them."""
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if request.prompt_logprobs is not None and request.stream:
        raise bad_request(
            "prompt_logprobs are not returned in a stream (as vLLM): drop stream or them", "prompt_logprobs"
        )


def response_id(prefix: str, request: SamplingRequest) -> str:
    """The response's id: `<prefix>-<request_id>` for a client's `request_id` (as vLLM)."""
    return f"{prefix}-{request.request_id}" if request.request_id is not None else random_id(prefix)


def prompt_logprobs_of(
    prompt_token_ids: list[int], rows: list[PositionLogprobs | None] | None, num_top: int
) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs`: None for the first position, then the prompt's token and the
    `num_top` most likely tokens at each (the engine may have computed more of them)."""
    if rows is None:
        return None
    return [
        None
        if row is None
        else {
            tid: PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in row.items()
            if tid == token_id or lp.rank <= num_top
        }
        for token_id, row in zip(prompt_token_ids, rows)
    ]


async def _best_beams(
    stream: AsyncIterator[RequestOutput], n: int, num_logprobs: int | None
) -> AsyncIterator[RequestOutput]:
    try:
        async for output in stream:
            yield top_completions(output, n, num_logprobs)
    finally:
        await _aclose(stream)


def make_admission(engine: AsyncLLM, limits: ServingLimits) -> Admission:
    """The server's one `Admission` (completions and chat share it)."""
    scheduler_config = engine.config.scheduler_config
    max_num_waiting = limits.max_num_waiting_requests
    if max_num_waiting is None:
        num_kv_blocks = getattr(engine.engine_core, "num_kv_blocks", None) or 0
        max_num_waiting = default_max_num_waiting(
            num_kv_blocks,
            engine.config.cache_config.block_size,
            engine.config.model_config.max_model_len,
            scheduler_config.max_num_seqs,
        )
    return Admission(scheduler_config.max_num_seqs, max_num_waiting)


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


# Characters JSON leaves raw that `str.splitlines` (so httpx's `aiter_lines`, and many SSE clients)
# takes for line ends, cutting an event in two; SSE itself ends lines only at CR and LF.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload, separators=(",", ":"))
    if not data.isascii():  # the escapes are JSON's own, so the event parses to the same text
        data = data.translate(_LINE_BREAKS_JSON_KEEPS)
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
    even when the cancellation lands outside the engine's own await.

    A client that stops reading fills the socket's buffers, and then a send waits: only this
    stream waits (the event loop serves everyone else), but its request would keep generating
    into memory. A send that waits longer than `stall_timeout_s` ends the stream, and so the
    request. The admission `ticket` is given back when the stream ends, however it ends."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncIterator[str], ticket: Ticket | None = None, stall_timeout_s: float | None = None
    ) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._ticket = ticket
        self._stall_timeout_s = stall_timeout_s

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(self._bounded(send))
        except StreamStalled:
            logger.warning(
                "A client stopped reading its stream for %g s; its request was aborted", self._stall_timeout_s
            )
        finally:
            with anyio.CancelScope(shield=True):
                await _aclose(self._events)
            if self._ticket is not None:
                self._ticket.release()

    def _bounded(self, send: Send) -> Send:
        if self._stall_timeout_s is None:
            return send
        timeout_s = self._stall_timeout_s

        async def bounded_send(message: Any) -> None:
            try:
                async with asyncio.timeout(timeout_s):
                    await send(message)
            except TimeoutError:
                raise StreamStalled from None

        return bounded_send


class StreamStalled(Exception):
    """A send to a stream's client waited longer than the stall timeout."""


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
