"""What a launched step hands back: `SampledStep`, its sampled tokens (and logprobs) still on
the device until `result()` reads them, so that the engine can launch the next step first (async
scheduling); `DeferredStep` when its sampling waits for a grammar bitmask; `FinishedStep` when
there was nothing to run."""

from __future__ import annotations

import torch

from shoal.step import LogprobsLists, ModelRunnerOutput
from shoal.workers.input_batch import RequestState
from shoal.workers.routed_experts import to_wire
from shoal.workers.sampler import SamplerOutput, logprobs_lists


class SampledStep:
    """A step's results still on the device; `result()` reads them back, which is the one
    host synchronization of a step."""

    def __init__(
        self,
        req_ids: list[str],
        states: list[RequestState],
        sampled: SamplerOutput | None,
        prompt_logprobs: dict[str, tuple[torch.Tensor, ...]],
        step_id: int,
        routed_experts: dict[str, tuple[int, torch.Tensor]] | None = None,
    ) -> None:
        self.req_ids = req_ids
        # Per request that asked and sampled: (first position, expert ids on the device).
        self.routed_experts = routed_experts or {}
        self.states = states
        self.sampled = sampled
        self.prompt_logprobs = prompt_logprobs
        self.step_id = step_id
        self.host_token_ids: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None
        if sampled is not None and sampled.sampled_token_ids.is_cuda:
            # Start the copy now; result() only waits for it.
            token_ids = sampled.sampled_token_ids
            self.host_token_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self.host_token_ids.copy_(token_ids, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        sampled_token_ids: list[list[int]] = [[] for _ in self.req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        if self.sampled is not None:
            if self.copied is not None:
                self.copied.synchronize()
            token_ids = self.host_token_ids if self.host_token_ids is not None else self.sampled.sampled_token_ids
            sampled_token_ids = self._per_request(token_ids.tolist())
            if self.sampled.logprobs is not None:
                logprobs = _split_logprobs(self.states, self.sampled)
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs={
                req_id: LogprobsLists(*(t.tolist() for t in tensors))
                for req_id, tensors in self.prompt_logprobs.items()
            },
            step_id=self.step_id,
            routed_experts=to_wire(self.routed_experts) if self.routed_experts else {},
        )

    def _per_request(self, tokens: list[int]) -> list[list[int]]:
        """The sampled tokens by request, in batch order: one for each request that sampled
        (`states`, a subsequence of `req_ids`), none for the others."""
        if len(self.states) == len(self.req_ids):  # every request sampled (a decode step)
            return [[t] for t in tokens]
        by_request = {s.req_id: [t] for s, t in zip(self.states, tokens, strict=True)}
        return [by_request.get(r, []) for r in self.req_ids]


class DeferredStep:
    """A launched step whose sampling waits for its grammar bitmask: `ModelRunner.sample_tokens`
    samples it and sets `step`, before anyone asks for the result."""

    def __init__(self) -> None:
        self.step: SampledStep | None = None

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if self.step is None:
            raise RuntimeError("a step was read back before its grammar bitmask came (sample_tokens)")
        return self.step.result(timeout)


class FinishedStep:
    """A step with nothing on the device to wait for."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        return self.output


def _split_logprobs(states: list[RequestState], result: SamplerOutput) -> dict[str, LogprobsLists]:
    """The sampled rows' logprobs, for the requests that asked for them."""
    assert result.logprob_token_ids is not None and result.logprobs is not None and result.sampled_ranks is not None
    wanted = [i for i, s in enumerate(states) if s.sampling_params.logprobs is not None]
    index = torch.tensor(wanted, device=result.logprobs.device)
    lists = logprobs_lists(
        result.logprob_token_ids[index],
        result.logprobs[index],
        result.sampled_ranks[index],
        [states[i].sampling_params.logprobs for i in wanted],
    )
    return {states[i].req_id: lp for i, lp in zip(wanted, lists)}
