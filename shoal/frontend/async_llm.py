"""`AsyncLLM`: the asyncio engine the server uses — one async generator per request.

One output-handler task reads the engine core's outputs, runs them through the
`OutputProcessor` and puts each `RequestOutput` on its request's queue. Closing or cancelling a
request's generator aborts it in the core (its KV blocks are freed). If the engine dies, every
open generator raises `EngineDeadError` and `check_health` fails from then on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from shoal.config import EngineArgs, EngineConfig
from shoal.errors import EngineDeadError
from shoal.frontend.beam_search import BeamSearch, step_params
from shoal.frontend.core_client import AsyncInprocClient, AsyncMPClient
from shoal.frontend.input_processor import PromptType
from shoal.frontend.llm import profile_directory
from shoal.frontend.lora_adapters import LoRAAdapters
from shoal.frontend.output_processor import OutputKind
from shoal.frontend.startup import start_engine
from shoal.frontend.stats import IterationStats, StatsTracker
from shoal.frontend.verb_methods import async_method, install_verb_methods
from shoal.lora.request import LoRARequest
from shoal.outputs import PositionLogprobs, RequestOutput
from shoal.protocol import SchedulerStats
from shoal.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
StatsListener = Callable[[SchedulerStats | None, IterationStats], None]


class AsyncLLM:
    def __init__(
        self, engine_args: EngineArgs, *, multiprocess: bool = True, log_stats: bool = True, engine_core: Any = None
    ) -> None:
        """`engine_core`: another client with `AsyncInprocClient`'s interface (the prefill/decode
        proxy's, shoal/entrypoints/disaggregated/proxy.py)."""
        self.engine_core: AsyncMPClient | AsyncInprocClient = engine_core or (
            AsyncMPClient() if multiprocess else AsyncInprocClient()
        )
        self.config: EngineConfig
        self.config, self.tokenizer, self.input_processor, self.output_processor = start_engine(
            self.engine_core, engine_args
        )
        self.log_stats = log_stats
        self._stats = StatsTracker()
        self._listeners: list[StatsListener] = []
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._handler: asyncio.Task | None = None
        self._dead: EngineDeadError | None = None
        self.lora_adapters = LoRAAdapters(self.config.lora_config is not None)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, multiprocess: bool = True) -> AsyncLLM:
        return cls(engine_args, multiprocess=multiprocess)

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def engine_core_pid(self) -> int | None:
        return self.engine_core.engine_core_pid

    def add_stats_listener(self, callback: StatsListener) -> None:
        self._listeners.append(callback)

    # ---- requests --------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        output_kind: OutputKind = OutputKind.DELTA,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come; the last one has `finished=True`.
        `lora_request`: the adapter to run it with (loaded first if the engine has not seen it)."""
        self._check_alive()
        text, token_ids = self.input_processor.tokenize(prompt)
        self.input_processor.validate_prompt(token_ids)
        self.input_processor.validate_params(sampling_params)  # cached: the server checked it already
        if lora_request is not None:
            await self.add_lora(lora_request)
        lora_name = self.lora_adapters.name_of(lora_request)
        queue = self._add_request(request_id, text, token_ids, sampling_params, output_kind, lora_name)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if output_kind == OutputKind.CUMULATIVE:
                    item = _latest(queue, item)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort(request_id)

    async def beam_search(
        self, prompt: PromptType, request_id: str, params: BeamSearchParams
    ) -> AsyncIterator[RequestOutput]:
        """Beam search (vLLM's `EngineClient.beam_search`; shoal/frontend/beam_search.py): one
        `RequestOutput` once the search is over, its completions the `beam_width` best beams,
        best first. Each round runs the live beams as one-token requests, side by side with
        every other request; closing the generator aborts the round under way."""
        self._check_alive()
        text, token_ids = self.input_processor.tokenize(prompt)
        self.input_processor.validate_prompt(token_ids)
        search = BeamSearch(
            token_ids, params, self.input_processor.stop_token_ids(), self.config.model_config.max_model_len
        )
        step = step_params(params)
        for round_index in itertools.count():
            if search.done:
                break
            rows = [
                self._next_token_row(beam, step, f"{request_id}-beam{round_index}-{i}")
                for i, beam in enumerate(search.prompts())
            ]
            search.advance(await _all_or_none(rows))
        yield search.request_output(request_id, text, self.tokenizer)

    async def _next_token_row(self, token_ids: list[int], params: SamplingParams, request_id: str) -> PositionLogprobs:
        final = None
        async for output in self.generate(
            {"prompt_token_ids": token_ids}, params, request_id, output_kind=OutputKind.FINAL_ONLY
        ):
            final = output
        logprobs = final.outputs[0].logprobs if final is not None else None
        return logprobs[0] if logprobs else {}

    def _add_request(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        kind: OutputKind,
        lora_name: str | None = None,
    ) -> asyncio.Queue[RequestOutput | BaseException]:
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._ensure_output_handler()
        children = self.output_processor.add_request(request_id, text, token_ids, params, kind)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        arrival = time.time()
        requests = [
            self.input_processor.process(child_id, token_ids, p, arrival, lora_name) for child_id, p in children
        ]
        self._stats.add_prompt([r.request_id for r in requests], arrival, len(token_ids), requests[0].max_tokens)
        for request in requests:
            self.engine_core.add_request(request)
        return queue

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        child_ids = self.output_processor.abort_request(request_id)
        for child_id in child_ids:
            self._stats.remove(child_id)
        if child_ids and self._dead is None:
            self.engine_core.abort_requests(child_ids)

    # ---- the output handler ----------------------------------------------------------------------

    def _ensure_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        if self._handler is None:
            self._handler = loop.create_task(self._handle_outputs())
        elif self._handler.get_loop() is not loop:
            raise RuntimeError("an AsyncLLM serves the event loop it was first used in; use one loop")

    async def _handle_outputs(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                processed = self.output_processor.process_outputs(outputs.outputs, outputs.weight_version)
                for request_output in processed.request_outputs:
                    queue = self._queues.get(request_output.request_id)
                    if queue is not None:
                        queue.put_nowait(request_output)
                if processed.reqs_to_abort:
                    self.engine_core.abort_requests(processed.reqs_to_abort)
                self._report_stats(outputs.scheduler_stats, outputs.outputs, processed.reqs_to_abort)
        except EngineDeadError as exc:
            self._fail_all(exc)
        except Exception as exc:  # a bug here must not leave callers waiting forever
            logger.exception("the output handler failed")
            self._fail_all(EngineDeadError(f"the output handler failed: {exc}"))

    def _report_stats(self, scheduler_stats: SchedulerStats | None, outputs: list, stopped: list[str]) -> None:
        if not self.log_stats:
            return
        iteration = self._stats.observe(outputs, stopped=set(stopped))
        for listener in self._listeners:
            try:
                listener(scheduler_stats, iteration)
            except Exception:  # a metrics bug must not stop serving
                logger.exception("stats listener failed")

    def _fail_all(self, error: EngineDeadError) -> None:
        self._dead = error
        logger.error("engine is dead: %s", error)
        for queue in self._queues.values():
            queue.put_nowait(error)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        dead = self.engine_core.dead_error
        if dead is not None:
            raise dead

    # ---- engine control --------------------------------------------------------------------------

    async def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None, timeout: float | None = None
    ) -> list[Any]:
        return await self._call("collective_rpc", method, list(args), kwargs, timeout)

    async def reset_prefix_cache(self) -> bool:
        return await self._call("reset_prefix_cache")

    # ---- LoRA adapters (docs/lora.md) ------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """As `LLM.add_lora` (a ValueError for a bad adapter; the engine keeps serving)."""
        if self.lora_adapters.needs_loading(lora_request):
            await self._call("add_lora", lora_request.lora_name, lora_request.lora_int_id, lora_request.path)
            self.lora_adapters.loaded[lora_request.lora_name] = lora_request
        return True

    async def remove_lora(self, lora_name: str) -> bool:
        await self._call("remove_lora", lora_name)
        self.lora_adapters.loaded.pop(lora_name, None)
        return True

    async def list_loras(self) -> dict[str, int]:
        return await self._call("list_loras")

    async def update_lora_weights_from_tensors(self, lora_name: str, named_tensors: Any) -> str:
        """As `LLM.update_lora_weights_from_tensors`."""
        from shoal.lora.tensors import encode_tensors

        return await self._call("update_lora_from_tensors", lora_name, encode_tensors(named_tensors))

    async def update_lora_weights_from_disk(self, lora_name: str, lora_path: str) -> str:
        """As `LLM.update_lora_weights_from_disk`."""
        version = await self._call("update_lora_from_disk", lora_name, lora_path)
        known = self.lora_adapters.loaded[lora_name]
        self.lora_adapters.loaded[lora_name] = LoRARequest(lora_name, known.lora_int_id, lora_path)
        return version

    async def get_lora_version(self, lora_name: str) -> str:
        return await self._call("get_lora_version", lora_name)

    # ---- RL rollouts (docs/rl.md) --------------------------------------------------------------
    # sleep / wake_up, pause_generation / resume_generation, the weight updates, ...: one
    # coroutine method per verb of shoal/rl_verbs.py, made from its declaration
    # (install_verb_methods, at the end of this file); each awaits `_call`.

    async def start_profile(self, profile_dir: str | None = None) -> None:
        """As `LLM.start_profile`."""
        await self.collective_rpc("start_profile", (profile_directory(profile_dir),))

    async def stop_profile(self) -> list[dict[str, Any]]:
        """As `LLM.stop_profile`."""
        return await self.collective_rpc("stop_profile")

    async def get_stats(self) -> dict[str, Any]:
        return await self._call("get_stats")

    async def check_health(self) -> None:
        self._check_alive()
        await self._call("check_health")

    async def _call(self, method: str, *args: Any) -> Any:
        self._check_alive()
        self._ensure_output_handler()
        return await self.engine_core.call_utility_async(method, *args)

    def shutdown(self) -> None:
        """Stop the engine: its core process (or in-process core), its workers and the placement
        group it made. Idempotent; dropping the last reference or leaving `async with` does the
        same (docs/rl.md, "Engine lifecycle")."""
        if self._handler is not None:
            self._handler.cancel()
            self._handler = None
        self.engine_core.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()


install_verb_methods(AsyncLLM, async_method)


async def _all_or_none(coroutines: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Their results; the first error (as it is, not in a group) cancels the others, whose
    requests abort as they unwind."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _latest(queue: asyncio.Queue, item: Any) -> Any:
    """The newest of the queued cumulative outputs: each holds everything so far, and all share
    the request's one completion, which later outputs have already updated, so an older output
    read late would pair its `finished` with a newer completion."""
    while not queue.empty() and not isinstance(item, BaseException):
        item = queue.get_nowait()
    return item
