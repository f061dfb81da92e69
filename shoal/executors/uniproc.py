"""`UniProcExecutor`: one worker in the engine-core process (CPU, or a single GPU)."""

from __future__ import annotations

from typing import Any

from shoal.executors.abstract import Executor, StepFuture
from shoal.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    # The worker is in this process: a step's bitmask can reach its sampler after the launch.
    samples_later = True

    def _init_workers(self) -> None:
        from shoal.workers.extension import create_worker

        self.worker = create_worker(self.config, rank=0)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        return [self.worker.call(method, args, kwargs or {})]

    def execute_model(  # type: ignore[override]
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | StepFuture:
        # The only worker always samples; non_block returns its step handle, whose result()
        # waits for the device (async scheduling launches the next step before that).
        output = self.worker.execute_model(scheduler_output, non_block)
        assert output is not None, "the only worker always samples"
        return output

    def sample_tokens(self, grammar: GrammarBitmask | None) -> None:
        self.worker.sample_tokens(grammar)

    def shutdown(self) -> None:
        self.worker.shutdown()
