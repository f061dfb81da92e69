"""`shoal batch`: run a file of OpenAI requests (the batch format, `batch_format.py`) through one
engine, or through N replicas on Ray Data (`--data-parallel-size`, `batch_data_parallel.py`).

Each request goes through the server's own handlers (`OpenAIServingCompletion`,
`OpenAIServingChat`) in this process, so a body is validated and answered exactly as
`shoal serve` would answer it: the same 400s, the same response objects. Every result line is
written whole as its request finishes; a rerun with the same output file skips the requests
already there, so a killed job loses only the requests that were in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.requests import Request

from shoal.entrypoints.batch_format import (
    BadLine,
    BatchLine,
    ResultWriter,
    bad_line_result,
    done_ids,
    is_done,
    read_input,
    result_line,
)
from shoal.entrypoints.openai.errors import to_api_error, validation_failed
from shoal.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from shoal.entrypoints.openai.serving_chat import ChatOptions, OpenAIServingChat
from shoal.entrypoints.openai.serving_completion import OpenAIServingCompletion

if TYPE_CHECKING:
    from shoal.config import EngineArgs
    from shoal.frontend.async_llm import AsyncLLM
    from shoal.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# Requests handed to the engine at once, per replica, as a multiple of max_num_seqs: enough to
# keep every batch slot busy, few enough that a huge file is not all in memory.
IN_FLIGHT_PER_SEQ = 2


class BatchRunner:
    """Answers batch lines with the server's handlers, on the engine it is given."""

    def __init__(self, engine: AsyncLLM, chat_options: ChatOptions | None = None) -> None:
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="shoal-tokenizer")
        self.completion = OpenAIServingCompletion(engine, self._tokenizer_thread)
        self.chat = OpenAIServingChat(engine, self._tokenizer_thread, chat_options)

    async def answer(self, item: BatchLine | BadLine) -> dict[str, Any]:
        """The output line for one input line; never raises for a bad request."""
        if isinstance(item, BadLine):
            return bad_line_result(item)
        try:
            status_code, body = await self._call(item)
        except Exception as exc:  # the server's error answer, as its exception handlers give it
            error = to_api_error(exc)
            status_code, body = error.status_code, error.body()
        return result_line(item.custom_id, status_code, body)

    async def _call(self, item: BatchLine) -> tuple[int, dict[str, Any]]:
        if item.url == "/v1/completions":
            response = await self.completion.create_completion(_parse(CompletionRequest, item.body), _NO_CLIENT)
        else:
            response = await self.chat.create_chat_completion(_parse(ChatCompletionRequest, item.body), _NO_CLIENT)
        return response.status_code, json.loads(bytes(response.body))

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False)


def _parse(model: type[CompletionRequest] | type[ChatCompletionRequest], body: dict[str, Any]) -> Any:
    """The body as the server's route parses it: a validation error is the server's 400."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_failed(RequestValidationError(exc.errors())) from exc


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()  # a batch request has no client that could go away
    return {"type": "http.disconnect"}


# The handlers watch their HTTP client for a disconnect; a batch request's never leaves.
_NO_CLIENT = Request({"type": "http", "method": "POST", "headers": []}, receive=_never_disconnects)


async def answer_all(
    runner: BatchRunner, items: Iterable[BatchLine | BadLine], max_in_flight: int, on_result: Any
) -> None:
    """Answer `items`, at most `max_in_flight` at once, calling `on_result(line)` as each finishes."""
    slots = asyncio.Semaphore(max_in_flight)
    tasks: set[asyncio.Task] = set()

    async def one(item: BatchLine | BadLine) -> None:
        try:
            on_result(await runner.answer(item))
        finally:
            slots.release()

    try:
        for item in items:
            await slots.acquire()
            task = asyncio.create_task(one(item))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


def pending_items(input_path: str | Path, output_path: str | Path) -> tuple[list[BatchLine | BadLine], int]:
    """(the input lines not yet in the output, how many are there already)."""
    items = read_input(input_path)
    done = done_ids(output_path)
    pending = [item for item in items if not is_done(item, done)]
    if done:
        logger.info("Resuming: %d of %d requests are in %s already", len(items) - len(pending), len(items), output_path)
    return pending, len(items) - len(pending)


def run_batch(
    engine_args: EngineArgs,
    input_path: str | Path,
    output_path: str | Path,
    *,
    data_parallel_size: int = 1,
    chat_options: ChatOptions | None = None,
    use_tqdm: bool = True,
    lora_modules: tuple[LoRARequest, ...] = (),
) -> int:
    """Answer every request of `input_path` not yet in `output_path`, appending a line to it as
    each finishes. With `data_parallel_size` > 1, through that many engine replicas on Ray Data.
    `lora_modules`: LoRA adapters to load first, which a line's `body.model` chooses by name.
    Returns the number of lines written."""
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}")
    pending, _ = pending_items(input_path, output_path)
    if not pending:
        return 0
    if data_parallel_size > 1:
        from shoal.entrypoints.batch_data_parallel import run_data_parallel

        if lora_modules:
            raise ValueError("LoRA adapters (--lora-modules) are served by one engine: drop --data-parallel-size")

        return run_data_parallel(engine_args, pending, output_path, data_parallel_size, chat_options, use_tqdm)
    return asyncio.run(_run_one_engine(engine_args, pending, output_path, chat_options, use_tqdm, lora_modules))


async def _run_one_engine(
    engine_args: EngineArgs,
    pending: list[BatchLine | BadLine],
    output_path: str | Path,
    chat_options: ChatOptions | None,
    use_tqdm: bool,
    lora_modules: tuple[LoRARequest, ...] = (),
) -> int:
    from tqdm import tqdm

    from shoal.entrypoints.openai.lora_routes import load_lora_modules
    from shoal.frontend.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        await load_lora_modules(engine, lora_modules)
    except BaseException:
        engine.shutdown()
        raise
    runner = BatchRunner(engine, chat_options)
    writer = ResultWriter(output_path)
    progress = tqdm(total=len(pending), desc="requests", unit="req", disable=not use_tqdm)

    def on_result(line: dict[str, Any]) -> None:
        writer.write(line)
        progress.update(1)

    try:
        await answer_all(runner, pending, IN_FLIGHT_PER_SEQ * engine_args.max_num_seqs, on_result)
    finally:
        progress.close()
        writer.close()
        runner.close()
        engine.shutdown()
    return len(pending)
