"""shoal as a veRL rollout engine, registered as "shoal" the way veRL registers its own engines
(modelled on veRL 0.9.1's TensorRT-LLM integration, verl/workers/rollout/trtllm_rollout/):

- `ShoalReplica` (a veRL `RolloutReplica`): one shoal engine per replica, in a Ray actor
  (`ShoalHttpServer`, named `shoal_server_{replica_rank}`) on the node of the replica's first
  bundle; the engine's workers take the replica's bundles of veRL's placement group (a share
  `1 / max_colocate_count` of each GPU, so that HYBRID and COLOCATED trainers keep theirs).
  `server_handle` generates token-in/token-out, `server_address` serves shoal's OpenAI API.
- `ShoalServerAdapter` (a veRL `BaseRollout`, `rollout.name=shoal`, mode async): the trainer's
  side: `resume(tags)`, `release()`, `update_weights(weights, global_steps)` in buckets of
  `checkpoint_engine.update_weights_bucket_megabytes`, sent by the replica's leader rank.

    import shoal.integrations.verl as shoal_verl
    shoal_verl.register()          # in the driver and in veRL's worker processes (a Ray runtime_env hook)
    # then: actor_rollout_ref.rollout.name=shoal

Importing this module imports veRL; the server logic itself lives in verl_server.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import ray
import torch
from verl.workers.rollout import base as verl_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput

from shoal.integrations.verl_server import ShoalRolloutServer

logger = logging.getLogger(__name__)

NAME = "shoal"


def register() -> None:
    """Make `rollout.name=shoal` resolve: the replica class and the server adapter."""
    RolloutReplicaRegistry.register(NAME, lambda: ShoalReplica)
    verl_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.ShoalServerAdapter"


def server_name(replica_rank: int, suffix: str = "") -> str:
    return f"shoal_server_{replica_rank}{suffix}"


class ShoalHttpServer(ShoalRolloutServer):
    """The replica's server actor: `ShoalRolloutServer` answering veRL's `TokenOutput`."""

    def __init__(self, config: Any, model_config: Any, rollout_mode: RolloutMode, replica_rank: int, **placement: Any):
        model_path = getattr(model_config, "local_path", None) or model_config.path
        super().__init__(config, model_path, rollout_mode.value, replica_rank, token_output=TokenOutput, **placement)


class ShoalReplica(RolloutReplica):
    # The server actor's Ray runtime_env (None: the job's).
    server_runtime_env: dict[str, Any] | None = None

    def rollout_worker_use_gpu(self) -> bool:
        return False  # the engine's own Ray workers take the GPUs

    def placement(self) -> tuple[Any, list[int]]:
        """This replica's placement group and bundles in veRL's resource pool (one group)."""
        first = self.world_size * self.replica_rank if self.rollout_mode != RolloutMode.STANDALONE else 0
        for pg in self.resource_pool.pgs:
            if first < pg.bundle_count:
                if first + self.world_size > pg.bundle_count:
                    raise ValueError("a shoal replica must lie within one placement group")
                return pg, list(range(first, first + self.world_size))
            first -= pg.bundle_count
        raise ValueError(f"replica {self.replica_rank} lies beyond the resource pool's bundles")

    async def launch_servers(self) -> None:
        pg, bundles = self.placement()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        share = 1.0 / max(1, getattr(self.resource_pool, "max_colocate_count", 1))
        node_id = ray.util.placement_group_table(pg)["bundles_to_node_id"][bundles[0]]
        server = (
            ray.remote(ShoalHttpServer)
            .options(
                name=server_name(self.replica_rank, self.name_suffix),
                max_concurrency=self.max_concurrency,
                num_cpus=0,
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id, soft=False),
                **({"runtime_env": self.server_runtime_env} if self.server_runtime_env else {}),
            )
            .remote(
                self.config,
                self.model_config,
                self.rollout_mode,
                self.replica_rank,
                placement_group=pg,
                bundle_indices=tuple(bundles),
                distributed_executor_backend="ray",
                device=device,
                **({"num_gpus_per_worker": share} if device == "cuda" else {"num_cpus_per_worker": share}),
            )
        )
        await server.launch_server.remote(host=ray.util.get_node_ip_address())
        self.servers.append(server)
        self._server_handle = server
        host, port = await server.get_server_address.remote()
        self._server_address = f"{host}:{port}"


class ShoalServerAdapter(BaseRollout):
    """The trainer's side in each of veRL's workers; only the replica's leader rank talks to
    the server, but every rank consumes the weights (their generator may hold collectives)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        if device_mesh is not None:  # HYBRID: [dp, infer_tp, ...], the replica is the dp index
            coordinate = device_mesh.get_coordinate()
            self.replica_rank, self.is_leader_rank = coordinate[0], all(c == 0 for c in coordinate[1:])
        else:
            self.replica_rank, self.is_leader_rank = replica_rank, int(os.environ.get("RANK", "0")) == 0
        self._server: Any = None

    def _server_actor(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        if self.is_leader_rank and getattr(self.config, "free_cache_engine", True):
            await self._server_actor().wake_up.remote(tags=list(tags))

    async def release(self) -> None:
        if self.is_leader_rank:
            await self._server_actor().sleep.remote()

    async def update_weights(
        self, weights: Any, global_steps: int | None = None, wire_format: str = "named_tensors", **kwargs: Any
    ) -> None:
        if wire_format != "named_tensors":
            raise ValueError(f"shoal takes whole named tensors; got wire_format={wire_format!r}")
        bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        version = None if global_steps is None else f"step-{global_steps}"
        async for bucket in _buckets(weights, bucket_bytes):
            if self.is_leader_rank:
                await self._server_actor().update_weights.remote(bucket, weight_version=version)
        if self.is_leader_rank and global_steps is not None:
            await self._server_actor().set_global_steps.remote(global_steps)


async def _buckets(weights: Any, max_bytes: int) -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs of a sync or async generator, at most `max_bytes` a bucket, as CPU
    tensors (Ray ships them to the server; a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    async for name, tensor in _aiter(weights):
        num_bytes = tensor.numel() * tensor.element_size()
        if bucket and size + num_bytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach().to("cpu", copy=True)))
        size += num_bytes
    if bucket:
        yield bucket


async def _aiter(weights: Iterable | AsyncIterator) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item
            await asyncio.sleep(0)
