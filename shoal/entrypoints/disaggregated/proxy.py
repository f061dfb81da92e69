"""The prefill/decode proxy: an engine-core client that runs each request on two engines.

`DisaggregatedLLM` is an `AsyncLLM` (tokenizer, chat templates, detokenizer, stop strings,
logprobs: the whole OpenAI server runs on it unchanged) whose engine core is
`DisaggregatedClient`. For each request the client

1. prefills it on a prefill engine (round robin): the same prompt, one token, no grammar or
   logprobs, with `role="save"` transfer params; the engine publishes the prompt's KV;
2. decodes it on a decode engine (round robin) with `role="load"` params: the engine loads the
   transferred KV into its own blocks and computes only the last prompt token, then generates
   with the request's own sampling parameters (structured output, logprobs, stop tokens);
3. streams the decode engine's outputs back as the request's own.

Failures, each bounded in time: an engine actor that died (`RayActorError`), an engine that
stops answering for `stall_timeout_s`, or a transfer that failed (`kv transfer failed` from
either side, itself bounded by `transfer_timeout_s`) retry the request from step 1, on the next
engines, while no token has reached the client, at most `max_attempts` times. Past that, or once
tokens were streamed, the request fails with `RequestUnavailableError` (HTTP 503). A transfer that
no decode engine loaded is deleted; a dead actor is restarted by Ray (`max_restarts`), and calls
made while it restarts wait for it, within the same bounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from shoal.config import EngineArgs, EngineConfig
from shoal.entrypoints.disaggregated.engine_pool import DisaggregationOptions, EnginePool, await_ref
from shoal.errors import EngineDeadError, RequestUnavailableError
from shoal.frontend.async_llm import AsyncLLM
from shoal.kv_transfer.params import KV_TRANSFER_FAILED, KVTransferError, KVTransferParams
from shoal.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)


class EngineStalledError(TimeoutError):
    """An engine gave no output for `stall_timeout_s`."""


class DisaggregatedClient:
    """`AsyncInprocClient`'s interface over a pool of prefill and a pool of decode engines."""

    engine_core_pid = None
    dead_error: EngineDeadError | None = None

    def __init__(self, options: DisaggregationOptions) -> None:
        self.options = options
        self.prefill: EnginePool | None = None
        self.decode: EnginePool | None = None
        self.num_kv_blocks = 0
        self._outputs: asyncio.Queue[EngineCoreOutput] | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        # Told of a request that cannot be served (the proxy's `AsyncLLM` fails its stream).
        self.on_failure: Callable[[str, BaseException], None] = lambda request_id, exc: None
        self.stats = {"pd_requests": 0, "pd_retries": 0, "pd_failures": 0}

    # ---- start and stop ----------------------------------------------------------------------

    def start(self, config: EngineConfig) -> None:
        from shoal.entrypoints.disaggregated.engine_actor import start_engine_actors

        self.prefill = EnginePool("prefill", start_engine_actors(config, "prefill", self.options))
        self.decode = EnginePool("decode", start_engine_actors(config, "decode", self.options))

    def wait_until_ready(self) -> None:
        import ray

        assert self.prefill is not None and self.decode is not None
        ready = ray.get([a.ready.remote() for a in self.prefill.actors + self.decode.actors])
        self.num_kv_blocks = min(r["num_kv_blocks"] for r in ready if r["role"] == "decode")
        self.pids = {r["pid"] for r in ready}

    def shutdown(self) -> None:
        import ray

        for task in self._tasks.values():
            task.cancel()
        for pool in (self.prefill, self.decode):
            for actor in pool.actors if pool else ():
                ray.kill(actor, no_restart=True)
        self.prefill = self.decode = None

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        loop = asyncio.get_running_loop()
        self.stats["pd_requests"] += 1
        self._tasks[request.request_id] = loop.create_task(self._serve(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            task = self._tasks.pop(request_id, None)
            if task is not None:
                task.cancel()

    async def get_output_async(self) -> EngineCoreOutputs:
        queue = self._queue()
        outputs = [await queue.get()]
        while not queue.empty():
            outputs.append(queue.get_nowait())
        return EngineCoreOutputs(outputs=outputs, timestamp=time.time())

    def _queue(self) -> asyncio.Queue[EngineCoreOutput]:
        if self._outputs is None:
            self._outputs = asyncio.Queue()
        return self._outputs

    async def _serve(self, request: EngineCoreRequest) -> None:
        """Prefill, transfer, decode; again on other engines after a failure, within bounds."""
        errors: list[str] = []
        streamed = False
        try:
            for attempt in range(1, self.options.max_attempts + 1):
                if attempt > 1:
                    self.stats["pd_retries"] += 1
                    await self._wait_for_engines()
                try:
                    async for output in self._attempt(request, attempt):
                        streamed = streamed or bool(output.new_token_ids)
                        output.request_id = request.request_id
                        self._queue().put_nowait(output)
                    return
                except (EngineStalledError, KVTransferError, _EngineFailed) as exc:
                    errors.append(f"attempt {attempt}: {exc}")
                    logger.warning("request %s: %s", request.request_id, errors[-1])
                    if streamed:
                        break  # tokens reached the client: a retry would repeat them
        except Exception as exc:  # a bug here must not leave the request waiting forever
            logger.exception("request %s: the proxy failed", request.request_id)
            errors.append(f"the proxy failed: {type(exc).__name__}: {exc}")
        finally:
            self._tasks.pop(request.request_id, None)
        self.stats["pd_failures"] += 1
        self.on_failure(
            request.request_id,
            RequestUnavailableError(f"request {request.request_id} could not be served: {'; '.join(errors)}"),
        )

    async def _wait_for_engines(self) -> None:
        """After a failure: until each role has an engine that answers, at most the stall
        timeout (Ray refuses calls to an actor while it restarts)."""
        assert self.prefill is not None and self.decode is not None
        for pool in (self.prefill, self.decode):
            await pool.wait_for_one(self.options.stall_timeout_s)

    async def _attempt(self, request: EngineCoreRequest, attempt: int) -> AsyncIterator[EngineCoreOutput]:
        assert self.prefill is not None and self.decode is not None
        transfer_id = f"{request.request_id}-{attempt}-{uuid.uuid4().hex[:8]}".replace("/", "_")
        remote_id = f"{request.request_id}@{attempt}"
        num_tokens = 0
        try:
            if _worth_prefilling(request):
                prefill = _prefill_request(request, remote_id, transfer_id)
                async for _ in self._stream(self.prefill, prefill):
                    pass
                num_tokens = len(request.prompt_token_ids) - 1
            decode = _decode_request(request, remote_id, transfer_id, num_tokens, self.options.transfer_timeout_s)
            async for output in self._stream(self.decode, decode):
                yield output
        finally:
            _discard_transfer(transfer_id)

    async def _stream(self, pool: EnginePool, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """The request's outputs from the pool's next engine; an abort, a stall or a dead actor
        raise (and make the engine a suspect). The request is aborted there if this stream ends
        early (cancelled, or it stalled)."""
        import ray

        actor = pool.next()
        stream = actor.generate.options(num_returns="streaming").remote(request)
        finished = False
        try:
            while not finished:
                try:
                    ref = await asyncio.wait_for(stream.__anext__(), self.options.stall_timeout_s)
                    output: EngineCoreOutput = await asyncio.wait_for(ref, self.options.stall_timeout_s)
                except StopAsyncIteration:
                    pool.suspect(actor)
                    raise _EngineFailed(f"{pool.role}: the engine's stream ended early") from None
                except TimeoutError:
                    pool.suspect(actor)
                    raise EngineStalledError(f"{pool.role}: no output for {self.options.stall_timeout_s:g} s") from None
                except ray.exceptions.RayError as exc:
                    pool.suspect(actor)
                    raise _EngineFailed(f"{pool.role}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
                finished = output.finished
                if (
                    finished
                    and output.finish_reason == "abort"
                    and str(output.stop_reason).startswith(KV_TRANSFER_FAILED)
                ):
                    raise KVTransferError(str(output.stop_reason))
                yield output
        finally:
            if not finished:
                actor.abort.remote([request.request_id])

    # ---- utility calls -----------------------------------------------------------------------

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        if method == "get_stats":
            return await self._stats()
        if method == "check_health":
            return await self._check_health()
        if method == "reset_prefix_cache":
            results = await asyncio.gather(*(a.reset_prefix_cache.remote() for a in self._actors()))
            return all(results)
        raise ValueError(f"{method} is not served by a disaggregated (prefill/decode) deployment")

    def _actors(self) -> list[Any]:
        return [a for pool in (self.prefill, self.decode) if pool for a in pool.actors]

    async def _stats(self) -> dict[str, Any]:
        """The engines' counters summed (those of engines that answer within a few seconds)."""
        totals: dict[str, Any] = dict(self.stats)
        results = await asyncio.gather(
            *(asyncio.wait_for(await_ref(a.get_stats.remote()), 5.0) for a in self._actors()), return_exceptions=True
        )
        for result in results:
            if isinstance(result, dict):
                for key, value in result.items():
                    if isinstance(value, int | float) and not isinstance(value, bool):
                        totals[key] = totals.get(key, 0) + value
        if totals.get("num_kv_blocks"):
            totals["kv_cache_usage"] = totals.get("num_used_blocks", 0) / totals["num_kv_blocks"]
        return totals

    async def _check_health(self) -> None:
        """Healthy while every role has an engine that answers (a restarting one does not)."""
        for pool in (self.prefill, self.decode):
            if pool is None:
                raise EngineDeadError("the disaggregated engines are shut down")
            results = await asyncio.gather(
                *(asyncio.wait_for(await_ref(a.ready.remote()), 5.0) for a in pool.actors), return_exceptions=True
            )
            if all(isinstance(r, BaseException) for r in results):
                raise EngineDeadError(f"no {pool.role} engine answers")


class _EngineFailed(RuntimeError):
    """An engine actor died, or ended a request's stream unfinished."""


def _worth_prefilling(request: EngineCoreRequest) -> bool:
    """A prompt of one token has nothing to transfer; prompt logprobs need every position's
    logits on the engine that reports them."""
    return len(request.prompt_token_ids) > 1 and request.sampling_params.prompt_logprobs is None


def _prefill_request(request: EngineCoreRequest, remote_id: str, transfer_id: str) -> EngineCoreRequest:
    """The prompt, one token, nothing the decode engine will not redo (grammar, logprobs)."""
    params = request.sampling_params
    prefill_params = msgspec.structs.replace(
        params,
        n=1,
        max_tokens=1,
        min_tokens=0,
        logprobs=None,
        structured_outputs=None,
        stop=[],
        extra_args=KVTransferParams(transfer_id=transfer_id, role="save").as_extra_args(params.extra_args),
    )
    return msgspec.structs.replace(request, request_id=remote_id, sampling_params=prefill_params, max_tokens=1)


def _decode_request(
    request: EngineCoreRequest, remote_id: str, transfer_id: str, num_tokens: int, timeout_s: float
) -> EngineCoreRequest:
    if not num_tokens:
        return msgspec.structs.replace(request, request_id=remote_id)
    load = KVTransferParams(transfer_id=transfer_id, role="load", num_tokens=num_tokens, timeout_s=timeout_s)
    params = msgspec.structs.replace(
        request.sampling_params, extra_args=load.as_extra_args(request.sampling_params.extra_args)
    )
    return msgspec.structs.replace(request, request_id=remote_id, sampling_params=params)


def _discard_transfer(transfer_id: str) -> None:
    """A transfer nobody loaded (a failed or cancelled attempt) is deleted (CPU transfers; a
    GPU transfer's buffer goes with its keep-alive)."""
    from shoal import envs
    from shoal.kv_transfer.shm_transport import discard_transfer

    discard_transfer(envs.SHOAL_KV_TRANSFER_DIR, transfer_id)


class DisaggregatedLLM(AsyncLLM):
    """An `AsyncLLM` whose requests run on prefill and decode engines (see the module doc)."""

    def __init__(self, engine_args: EngineArgs, options: DisaggregationOptions, log_stats: bool = True) -> None:
        client = DisaggregatedClient(options)
        client.on_failure = self._fail_request
        super().__init__(engine_args, log_stats=log_stats, engine_core=client)
        self.options = options

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        """One request (a child of `n`) cannot be served: its stream raises `error`."""
        child = self.output_processor.children.get(request_id)
        parent_id = child.parent.request_id if child is not None else request_id
        queue = self._queues.get(parent_id)
        if queue is not None:
            queue.put_nowait(error)
