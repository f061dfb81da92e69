"""`EngineActor`: one engine core in a Ray actor, for the prefill/decode proxy.

The actor holds an in-process engine core (`AsyncInprocClient`: the core's steps run in a thread,
its workers in the actor or, with Ray workers, beside it) and serves requests one stream each:
`generate` yields a request's `EngineCoreOutput`s until it finishes (a Ray streaming generator).
No tokenizer lives here: the proxy's `AsyncLLM` tokenizes and detokenizes. Ray restarts an actor
whose process died (`max_restarts`), building a fresh engine; the proxy retries meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from shoal.config import EngineConfig
from shoal.protocol import EngineCoreOutput, EngineCoreRequest

if TYPE_CHECKING:
    from shoal.entrypoints.disaggregated.engine_pool import DisaggregationOptions

logger = logging.getLogger(__name__)


class EngineActor:
    def __init__(self, config: EngineConfig, role: str) -> None:
        from shoal.frontend.core_client import AsyncInprocClient

        self.role = role
        self.client = AsyncInprocClient()
        self.client.start(config)
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput]] = {}
        self._pump: asyncio.Task | None = None
        logger.info("%s engine ready (pid %d)", role, os.getpid())

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "role": self.role, "num_kv_blocks": self.client.num_kv_blocks}

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """The request's outputs as the core makes them; the last one is finished. A request
        whose stream is dropped or cancelled is aborted (its blocks freed)."""
        self._ensure_pump()
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        self.client.add_request(request)
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            self._queues.pop(request.request_id, None)
            if not finished:
                self.client.abort_requests([request.request_id])

    async def abort(self, request_ids: list[str]) -> None:
        self.client.abort_requests(request_ids)
        for request_id in request_ids:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(EngineCoreOutput(request_id, [], finish_reason="abort"))

    async def get_stats(self) -> dict[str, Any]:
        return await self.client.call_utility_async("get_stats")

    async def reset_prefix_cache(self) -> bool:
        return await self.client.call_utility_async("reset_prefix_cache")

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._pump_outputs())

    async def _pump_outputs(self) -> None:
        """Step the core and hand each output to its request's stream. If the core dies, every
        stream ends unfinished and the process exits, for Ray to start a fresh engine."""
        try:
            while True:
                outputs = await self.client.get_output_async()
                for output in outputs.outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
        except Exception:
            logger.exception("the %s engine died", self.role)
            os._exit(1)


def start_engine_actors(config: EngineConfig, role: str, options: DisaggregationOptions) -> list[Any]:
    """`options.num_<role>` engine actors, each its own engine with `kv_transfer_role=role`;
    Ray re-creates one whose process died (`max_restarts`), never retrying a call itself (the
    proxy does, on other engines)."""
    import ray

    from shoal import envs
    from shoal.executors.ray_utils import connect_to_ray

    connect_to_ray(config.parallel_config.ray_address, None)
    engine_config = dataclasses.replace(
        config, cache_config=dataclasses.replace(config.cache_config, kv_transfer_role=role)
    )
    actor_class = ray.remote(EngineActor).options(
        num_cpus=options.num_cpus_per_engine,
        num_gpus=options.num_gpus_per_engine,
        max_restarts=options.max_restarts,
        max_task_retries=0,
        runtime_env={"env_vars": envs.forwarded_environment()},
    )
    count = options.num_prefill if role == "prefill" else options.num_decode
    return [actor_class.remote(engine_config, role) for _ in range(count)]
