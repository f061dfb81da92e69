"""The experts a mixture-of-experts model routes each token to, recorded for the requests that
ask (`SamplingParams.return_routed_experts`): what an RL trainer replays so that its forward
uses the rollout's routing (routing replay, "R3").

A step records only when one of its requests asks: forward hooks on every router (`MoEGate`)
are registered for that forward alone and keep its top-k ids on the device; other steps run
the model untouched (and may replay CUDA graphs). Each asking request's rows are kept on the
device until the request samples a token, then travel back with that step's tokens
(`ModelRunnerOutput.routed_experts`), read to the host with them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from shoal.layers.moe.gate import MoEGate
from shoal.step import RoutedExperts, SchedulerOutput

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RoutedExpertsRecorder:
    """The routers of one model (its decoder layers' `MoEGate`s, by layer index) and what the
    asking requests' positions were routed to since they last sampled."""

    def __init__(self, gates: list[tuple[int, MoEGate]], num_layers: int, top_k: int) -> None:
        self.gates = gates
        self.num_layers = num_layers
        self.top_k = top_k
        self.asking: set[str] = set()
        # Per asking request: (first position, expert ids [n, num_layers, top_k] int32) chunks.
        self.pending: dict[str, list[tuple[int, torch.Tensor]]] = {}

    @classmethod
    def for_model(cls, model: nn.Module, num_layers: int) -> RoutedExpertsRecorder | None:
        """The recorder of a model with routers; None for a dense model."""
        gates = []
        for name, module in model.named_modules():
            match = _LAYER_INDEX.search(name)
            if isinstance(module, MoEGate) and match is not None:
                gates.append((int(match.group(1)), module))
        if not gates:
            return None
        return cls(gates, num_layers, gates[0][1].routing.top_k)

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Learn the step's new asking requests; forget finished (or preempted) ones."""
        for req_id in scheduler_output.finished_req_ids:
            self.asking.discard(req_id)
            self.pending.pop(req_id, None)
        for new in scheduler_output.new_reqs:
            if new.sampling_params.return_routed_experts:
                self.asking.add(new.req_id)

    def asking_in(self, req_ids: list[str]) -> list[int]:
        """The batch indices of the step's requests that ask (usually none: no work)."""
        if not self.asking:
            return []
        return [i for i, r in enumerate(req_ids) if r in self.asking]

    @contextmanager
    def capture(self, wanted: bool) -> Iterator[list[torch.Tensor]]:
        """Around a forward: each router's top-k ids [num_tokens, top_k], in the order the
        routers ran (the gates' order, layer by layer); nothing when not `wanted`."""
        captured: list[torch.Tensor] = []
        if not wanted:
            yield captured
            return

        def keep(module: nn.Module, args: object, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            captured.append(output[1])

        handles = [gate.register_forward_hook(keep) for _, gate in self.gates]
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    def keep_rows(
        self,
        captured: list[torch.Tensor],
        req_ids: list[str],
        asking: list[int],
        query_start_loc: list[int],
        first_positions: list[int],
    ) -> None:
        """File the step's captured ids under each asking request: request i's tokens are
        rows `query_start_loc[i]:query_start_loc[i + 1]`, the first at `first_positions[i]`."""
        if len(captured) != len(self.gates):
            raise RuntimeError(f"{len(captured)} routers ran, the model has {len(self.gates)}")
        num_tokens = captured[0].shape[0]
        ids = torch.full((num_tokens, self.num_layers, self.top_k), -1, dtype=torch.int32, device=captured[0].device)
        layers = torch.tensor([layer for layer, _ in self.gates], device=ids.device)
        ids[:, layers] = torch.stack(captured, dim=1).to(torch.int32)  # [num_tokens, num_moe_layers, top_k]
        for i in asking:
            rows = ids[query_start_loc[i] : query_start_loc[i + 1]]
            self.pending.setdefault(req_ids[i], []).append((first_positions[i], rows))

    def take_sampled(self, sampling_req_ids: list[str]) -> dict[str, tuple[int, torch.Tensor]]:
        """The rows kept for the requests that sample this step, as (first position, ids)."""
        taken = {}
        for req_id in sampling_req_ids:
            chunks = self.pending.pop(req_id, None)
            if chunks:
                taken[req_id] = (chunks[0][0], torch.cat([rows for _, rows in chunks]))
        return taken


def to_wire(kept: dict[str, tuple[int, torch.Tensor]]) -> dict[str, RoutedExperts]:
    """The kept rows read back to the host, as the step's wire type."""
    wire = {}
    for req_id, (start, ids) in kept.items():
        host = ids.cpu().contiguous()
        wire[req_id] = RoutedExperts(start, host.shape[1], host.shape[2], host.numpy().tobytes())
    return wire
