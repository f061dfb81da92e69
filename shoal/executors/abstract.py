"""`Executor`: the engine core's narrow view of its workers.

An executor starts the workers, sizes and allocates the KV cache on all of them, runs each
step, and forwards `collective_rpc` calls. `UniProcExecutor` runs one worker in the engine-core
process; `RayExecutor` runs one worker actor per GPU (or CPU bundle) in a placement group.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Literal, Protocol, overload

from shoal.config import EngineConfig
from shoal.errors import EngineDeadError, WorkerDiedError
from shoal.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)
__all__ = ["EngineDeadError", "Executor", "StepFuture", "WorkerDiedError"]


class StepFuture(Protocol):
    """A step still running on the workers (`execute_model(..., non_block=True)`)."""

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        """Wait for the step; its sampled tokens, or `WorkerDiedError` if a worker died
        (`EngineDeadError` if the workers failed otherwise)."""
        ...


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_workers()

    @staticmethod
    def create(config: EngineConfig) -> Executor:
        backend = config.parallel_config.distributed_executor_backend
        if backend == "ray":
            from shoal.executors.ray_executor import RayExecutor

            return RayExecutor(config)
        from shoal.executors.uniproc import UniProcExecutor

        return UniProcExecutor(config)

    @abstractmethod
    def _init_workers(self) -> None:
        """Start the workers, initialize their devices and load the model."""

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call `method` on every worker; returns each worker's result in rank order."""

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[False] = False
    ) -> ModelRunnerOutput: ...

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: Literal[True]) -> StepFuture: ...

    @abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | StepFuture:
        """Run one step on all workers; returns the sampling rank's output, or with
        `non_block=True` (pipeline parallelism keeps several steps in flight) a `StepFuture`."""

    # Whether a step's grammar bitmask may follow its launch (`SchedulerOutput.grammar_follows`,
    # then `sample_tokens`); otherwise the step carries it.
    samples_later: bool = False

    def sample_tokens(self, grammar: GrammarBitmask | None) -> None:
        """Sample the launched step that awaits its grammar bitmask (`grammar_follows`), with
        `grammar` applied (None: no structured row constrains its token after all)."""
        raise NotImplementedError(f"{type(self).__name__} takes a step's bitmask with the step")

    def initialize_kv_cache(self) -> int:
        """Size the KV cache (the smallest that fits on every worker) and allocate it
        everywhere; returns the number of blocks."""
        override = self.config.cache_config.num_gpu_blocks_override
        num_blocks = override or min(self.collective_rpc("determine_num_kv_blocks"))
        if num_blocks < 1:
            raise RuntimeError(
                "no memory is left for the KV cache: lower max_num_batched_tokens, "
                "raise gpu_memory_utilization / kv_cache_memory_bytes, or use a smaller model"
            )
        self.collective_rpc("initialize_kv_cache", (num_blocks,))
        return num_blocks

    def check_health(self) -> None:
        """Raise `EngineDeadError` if the workers cannot run (an in-process worker cannot be
        gone); `WorkerDiedError` names workers that died and may be re-created."""
        return None

    def restart_workers(self, ranks: list[int], num_kv_blocks: int) -> None:
        """Re-create the workers of `ranks` (after `WorkerDiedError`) so that every rank can
        run steps again: the new ones loaded, every rank's groups re-formed, every KV cache
        allocated again with `num_kv_blocks` blocks and no request in any batch. Raises
        `EngineDeadError` when that cannot be done."""
        raise EngineDeadError(f"{type(self).__name__} cannot restart workers")

    def shutdown(self) -> None:
        """Stop the workers and free their resources."""
        return None
