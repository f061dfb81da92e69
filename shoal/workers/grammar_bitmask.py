"""The model runner's side of structured output: `StructuredSampling` keeps a step whose
bitmask follows its launch until `sample_tokens` brings it, and applies a step's bitmask to its
sampling metadata; `GrammarBitmaskLoader` puts the bitmask (`GrammarBitmask`) onto the device,
with the sampling rows it belongs to.

On a GPU the bitmask goes through one of two pinned host buffers, used in turn, each reused only
after an event says its last copy has run: a copy from pageable memory would make the host wait
for everything queued before it on the stream — with async scheduling, the forward of the very
step being sampled — and the host work of the next step would no longer overlap the device's.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import numpy as np
import torch

from shoal.step import GrammarBitmask
from shoal.workers.sampler import SamplingMetadata, with_token_bitmask
from shoal.workers.step_output import DeferredStep

Step = TypeVar("Step")


class StructuredSampling(Generic[Step]):
    """What the runner does with a step's grammar: `defer` the sampling of a step whose bitmask
    follows (`SchedulerOutput.grammar_follows`), hand it back when the bitmask comes
    (`take_deferred`), and `apply` a bitmask to a step's sampling metadata."""

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.loader = GrammarBitmaskLoader(max_num_reqs, device)
        self._deferred: tuple[Step, DeferredStep] | None = None

    def defer(self, step: Step) -> DeferredStep:
        """Keep `step` (its logits) until its bitmask comes; the handle that reads it back."""
        deferred = DeferredStep()
        self._deferred = (step, deferred)
        return deferred

    def take_deferred(self) -> tuple[Step, DeferredStep]:
        if self._deferred is None:
            raise RuntimeError("no step is waiting for its grammar bitmask")
        deferred, self._deferred = self._deferred, None
        return deferred

    def apply(
        self, metadata: SamplingMetadata, grammar: GrammarBitmask, sampling_req_ids: list[str]
    ) -> SamplingMetadata:
        """The metadata with the bitmask's rows, on the device, at the sampling rows of their
        requests (`sampling_req_ids`, the step's rows in order)."""
        return with_token_bitmask(metadata, *self.loader.load(grammar, sampling_req_ids))


class GrammarBitmaskLoader:
    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.device = device
        self._pinned = device.type == "cuda"
        self._staging: list[torch.Tensor] = []  # two [max_num_reqs, 1 + num_words] int32 buffers
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def load(self, grammar: GrammarBitmask, sampling_req_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bitmask [num_masked, num_words] int32, its sampling rows or None for every row in
        order) on the device. Row i of the bitmask is for `grammar.req_ids[i]`, whose sampling
        row is its place in `sampling_req_ids`."""
        num_rows, num_words = len(grammar.req_ids), grammar.num_words
        bitmask = np.frombuffer(grammar.bitmask, dtype=np.int32).reshape(num_rows, num_words)
        position = {req_id: row for row, req_id in enumerate(sampling_req_ids)}
        rows = np.fromiter((position[r] for r in grammar.req_ids), dtype=np.int32, count=num_rows)
        every_row = num_rows == len(sampling_req_ids) and bool((rows == np.arange(num_rows)).all())
        # Column 0 carries each row's sampling row, so that one copy moves both.
        host = self._host(num_rows, num_words)
        host[:, 0] = rows
        host[:, 1:] = bitmask
        loaded = self._to_device(host)
        return loaded[:, 1:], None if every_row else loaded[:, 0].long()

    def _host(self, num_rows: int, num_words: int) -> np.ndarray:
        if not self._pinned:
            return np.empty((num_rows, 1 + num_words), dtype=np.int32)
        if not self._staging or self._staging[0].shape[1] != 1 + num_words:
            shape = (self.max_num_reqs, 1 + num_words)
            self._staging = [torch.empty(shape, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()  # its copy of two steps ago has run (it always has, by now)
        return self._staging[self._turn][:num_rows].numpy()

    def _to_device(self, host: np.ndarray) -> torch.Tensor:
        if not self._pinned:
            return torch.from_numpy(host)
        tensor = self._staging[self._turn][: host.shape[0]].to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[self._turn] = event
        self._turn = 1 - self._turn
        return tensor
