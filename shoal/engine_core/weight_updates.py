"""Weight updates of an engine core: the RL rollout contract's four sources of new weights
(see docs/rl.md). `EngineCore` inherits these; the frontend calls them as utility methods (the
RL verbs of shoal/rl_verbs.py).

Each update lands the steps still in flight (no step runs while weights are written), has
every worker check the whole batch and then write it (shoal/workers/weight_updates.py), then
resets the prefix cache (its blocks hold keys and values of the old weights) unless
`reset_prefix_cache=False`, and advances the weight version (`weight_version` names it). A
worker's refusal (unknown name, wrong shape or dtype, weights asleep) is a `ValueError` here,
and nothing was written.

An update from tensors may come in several calls (one CUDA-IPC bucket each, so that the caller
never holds more than one packed bucket): every call but the last passes `final=False`, and
scheduling is held from the first call to the last, so that no step runs with half-written
weights. Plain Python: no torch here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from shoal.config import EngineConfig
from shoal.engine_core.scheduler import Scheduler
from shoal.executors.abstract import Executor
from shoal.rl_verbs import DEFAULT_BUCKET_BYTES

logger = logging.getLogger(__name__)

WEIGHT_UPDATE_BACKENDS = (None, "gloo", "nccl")


class WeightUpdateControl:
    config: EngineConfig
    scheduler: Scheduler
    executor: Executor

    def _land_steps_in_flight(self) -> None: ...

    def _raise_refusals(self, answers: list[Any]) -> None:
        refusals = [answer for answer in answers if answer]
        if refusals:
            raise ValueError(refusals[0])

    def _update(
        self, method: str, args: tuple, weight_version: str | None, reset_prefix_cache: bool, final: bool = True
    ) -> str:
        start = time.perf_counter()
        self._land_steps_in_flight()
        self._raise_refusals(self.executor.collective_rpc(method, args))
        if not final:
            self.scheduler.hold_for_weight_update()
            return self.scheduler.weight_version
        if reset_prefix_cache:
            self.scheduler.reset_prefix_cache()
        version = self.scheduler.advance_weight_version(weight_version)
        logger.info("weights updated (%s) in %.2f s: version %s", method, time.perf_counter() - start, version)
        return version

    # ---- the four sources -------------------------------------------------------------------

    def update_weights_from_disk(
        self, path: str, weight_version: str | None = None, reset_prefix_cache: bool = True
    ) -> str:
        """Load every tensor of the safetensors folder `path`; returns the new weight version."""
        return self._update("update_weights_from_disk", (str(path),), weight_version, reset_prefix_cache)

    def update_weights_from_tensors(
        self,
        buckets: list[dict[str, Any]],
        weight_version: str | None = None,
        reset_prefix_cache: bool = True,
        final: bool = True,
    ) -> str:
        """Load buckets of tensors from the caller's process (see shoal/rl/tensor_transfer.py)."""
        return self._update("update_weights_from_tensors", (buckets,), weight_version, reset_prefix_cache, final)

    def check_weights(self, metas: list[list[Any]]) -> None:
        """Raise ValueError if an update of these [name, dtype, shape] would be refused."""
        self._raise_refusals(self.executor.collective_rpc("check_weights", (metas,)))

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        backend: str | None = None,
        group_name: str | None = None,
    ) -> None:
        """Join the trainer's weight-update group: worker rank r becomes rank `rank_offset + r`
        of `world_size` (rank 0 is the trainer's `WeightSender`, constructed meanwhile; with
        `group_name`, the torch process group of that name that SGLang's trainers build)."""
        num_workers = self.config.parallel_config.world_size
        if backend not in WEIGHT_UPDATE_BACKENDS:
            raise ValueError(f"backend must be one of {WEIGHT_UPDATE_BACKENDS}, got {backend!r}")
        if rank_offset < 1 or rank_offset + num_workers > world_size:
            raise ValueError(
                f"rank_offset={rank_offset} and this engine's {num_workers} worker(s) do not fit in "
                f"world_size={world_size} (rank 0 is the trainer's)"
            )
        args = (master_address, int(master_port), rank_offset, world_size, backend, group_name)
        self._raise_refusals(self.executor.collective_rpc("init_weight_update_group", args))

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: str | None = None,
        reset_prefix_cache: bool = True,
        bucket_bytes: int | None = None,
    ) -> str:
        """Receive the trainer's broadcast of these tensors, in buckets of `bucket_bytes` (the
        sender's; default `DEFAULT_BUCKET_BYTES`); returns the new weight version."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
        args = (list(names), list(dtypes), [list(s) for s in shapes], int(bucket_bytes or DEFAULT_BUCKET_BYTES))
        return self._update("update_weights_from_distributed", args, weight_version, reset_prefix_cache)

    def destroy_weight_update_group(self) -> None:
        self.executor.collective_rpc("destroy_weight_update_group")

    def update_weight_version(self, new_version: str) -> str:
        """Rename the version of the weights in place (no weights change): later steps run with
        version `new_version`."""
        if not new_version:
            raise ValueError("new_version must be a non-empty string")
        self.scheduler.weight_version = new_version
        return new_version

    def get_weight_version(self) -> str:
        """The version of the weights that steps run with now ("0" until the first update)."""
        return self.scheduler.weight_version
