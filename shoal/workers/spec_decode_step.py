"""`SpeculativeStep`: the model runner's side of speculative decoding (docs/spec_decode.md).

The runner reaches it at four seams of a step:

1. `write_drafts`, after the input batch takes the scheduler's diffs: each request's scheduled
   drafts go into its token row just past its known tokens (not counted in `num_tokens`), so
   the runner's gather gives the verification forward its last token and its drafts, with their
   positions and slots (the scheduler counted and allocated 1 + n tokens).
2. `lay_out`, on the step's inputs: logits at `DraftLayout.logits_indices` (each drafting
   request's last 1 + n rows), and no plain sampling metadata (the rows' is built per row).
3. `sample`, after the forward: with no drafts in the step, the runner's own sampler; else the
   rejection sampler over the verification rows (`verification_sampling_metadata`: row j samples
   as if drafts 0..j-1 were emitted; the grammar's bitmask at each structured request's rows,
   row j from its grammar advanced over drafts 0..j-1, which the
   scheduler cut where the grammar refused one). The emitted tokens come back as lists,
   logprobs row by row.
4. The proposer, last: the emitted tokens are written into the rows (the scheduler's next diff
   writes the same ones), and it drafts the next step's tokens from them (n-gram), or from the
   target's states of this step (draft model, EAGLE heads, MTP, which also run their step pass
   over every row so that their KV cache has no holes). A step that replayed a verification
   graph computed a padded batch (verify_graphs.py): the drafters get its real rows only.

Only the sampling rank verifies and proposes; every rank runs the same forward. The step reads
its tokens back before it returns (the drafts depend on them), so the engine turns async
scheduling off with speculation.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

from shoal.distributed.parallel_state import get_tp_group
from shoal.spec_decode.config import SpeculativeConfig
from shoal.spec_decode.draft_layout import DraftLayout
from shoal.spec_decode.proposer import Drafts, Proposer, ProposerInputs, TargetStates, make_proposer
from shoal.spec_decode.rejection_sampler import RejectionSampler, RejectionSamplerOutput, verification_sampling_metadata
from shoal.step import GrammarBitmask, LogprobsLists, ModelRunnerOutput, SchedulerOutput
from shoal.workers.input_batch import RequestState
from shoal.workers.sampler import logprobs_lists, with_token_bitmask

if TYPE_CHECKING:
    from shoal.workers.model_runner import ModelRunner, StepInputs

logger = logging.getLogger(__name__)

# An RL update's tensors for a separate draft model carry this prefix before its own names.
DRAFT_MODEL_PREFIX = "draft_model."


@dataclasses.dataclass
class _Verification:
    """This step's drafts, by sampling request."""

    drafts: list[list[int]]
    layout: DraftLayout


class SpeculativeStep:
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner) -> None:
        self.config = config
        self.runner = runner
        self.proposer: Proposer = make_proposer(
            config,
            block_size=runner.block_size,
            target_path=runner.model_config.model,
            model_config=runner.model_config,
        )
        self.rejection_sampler = RejectionSampler(config.num_speculative_tokens, config.accept_all_drafts)
        self._verification: _Verification | None = None

    # ---- the drafter's model and KV cache ------------------------------------------------------

    def load_model(self, target_model: torch.nn.Module) -> None:
        self.proposer.load_model(target_model)

    def kv_cache_block_bytes(self) -> int:
        return self.proposer.kv_cache_block_bytes()

    def initialize_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        """The drafter's KV cache, the target's block count; its tensors (for sleep)."""
        self.proposer.initialize_kv_cache(num_blocks)
        return list(getattr(self.proposer, "kv_caches", []))

    @property
    def drafter_module(self) -> torch.nn.Module | None:
        """The drafter's own module (None for n-gram): sleep releases its weights too."""
        drafter = getattr(self.proposer, "_drafter", None)
        return drafter if isinstance(drafter, torch.nn.Module) else None

    def split_weights(
        self, weights: Iterable[tuple[str, Any]]
    ) -> tuple[Iterator[tuple[str, Any]], list[tuple[str, Any]]]:
        """An RL update's tensors: (the target's, streamed as they come; the drafter's, filled
        while the target's are read). A draft model's are those named `draft_model.<its name>`;
        an EAGLE head or MTP module takes its own from the target's names (and sees a tied
        embedding or LM head through the target's modules)."""
        drafter: list[tuple[str, Any]] = []
        reads_target_names = self.config.method in ("eagle", "eagle3", "mtp")

        def target() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                if name.startswith(DRAFT_MODEL_PREFIX):
                    drafter.append((name[len(DRAFT_MODEL_PREFIX) :], tensor))
                    continue
                if reads_target_names:
                    drafter.append((name, tensor))
                yield name, tensor

        return target(), drafter

    def load_weights(self, weights: list[tuple[str, Any]]) -> set[str]:
        return self.proposer.load_weights(weights) if weights else set()

    # ---- one step -----------------------------------------------------------------------------

    def write_drafts(self, scheduler_output: SchedulerOutput) -> None:
        """Each scheduled draft into its request's token row past its known tokens (uncounted)."""
        batch = self.runner.input_batch
        batch.num_draft_tokens.fill(0)
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            slot = batch.requests[req_id].slot
            start = int(batch.num_tokens[slot])
            batch.token_ids[slot, start : start + len(drafts)] = drafts
            batch.num_draft_tokens[slot] = len(drafts)

    def lay_out(self, inputs: StepInputs, scheduler_output: SchedulerOutput) -> StepInputs:
        """The inputs with logits at each sampling request's verification rows."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        drafts = [spec.get(req_id, []) for req_id in inputs.sampling_req_ids]
        layout = DraftLayout.of([len(d) for d in drafts])
        self._verification = _Verification(drafts, layout)
        if layout.num_drafts == 0:
            return inputs
        logits_indices = layout.logits_indices(inputs.logits_indices + 1)  # each request's query end
        return dataclasses.replace(inputs, logits_indices=logits_indices, sampling_metadata=None)

    def sample(
        self,
        inputs: StepInputs,
        model_output: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        scheduler_output: SchedulerOutput,
        slots: np.ndarray,
    ) -> ModelRunnerOutput | None:
        """Verify the drafts (or sample), then propose the next step's; None off the sampling rank."""
        runner = self.runner
        hidden_states, aux = model_output if isinstance(model_output, tuple) else (model_output, None)
        verification = self._verification
        assert verification is not None
        states = [runner.input_batch.requests[r] for r in inputs.sampling_req_ids]
        num_tokens = inputs.attn_metadata.num_tokens
        logits = runner._logits(hidden_states, inputs.logits_indices, num_tokens) if states else None
        prompt_logprobs = runner._prompt_logprobs(inputs, hidden_states)
        drafter_hidden_states = hidden_states if aux is None else aux
        if not runner.is_sampling_rank:
            if self._drafts_on_every_rank:  # a sharded drafter runs on every rank, in step
                emitted = self._receive_emitted(len(states))
                self._propose(inputs, drafter_hidden_states, slots, emitted, verification)
            return None
        if verification.layout.num_drafts == 0:
            from shoal.workers.model_runner import _LogitsOfStep

            step = _LogitsOfStep(inputs, states, logits, prompt_logprobs, scheduler_output.step_id)
            output = runner._sample_logits(step, scheduler_output.grammar).result()
            by_request = dict(zip(output.req_ids, output.sampled_token_ids))
            emitted = [by_request[r] for r in inputs.sampling_req_ids]
        else:
            assert logits is not None
            verified = self._verify(logits, states, verification, scheduler_output.grammar, inputs.sampling_req_ids)
            output, emitted = self._output(
                inputs, states, verified, verification.layout, prompt_logprobs, scheduler_output
            )
        runner.keep_samples(inputs.sampling_slots, None)
        if self._drafts_on_every_rank:
            self._send_emitted(emitted)
        drafts = self._propose(inputs, drafter_hidden_states, slots, emitted, verification)
        spec_token_ids = [drafts.get(req_id, []) for req_id in output.req_ids]
        return msgspec.structs.replace(output, spec_token_ids=spec_token_ids)

    @property
    def _drafts_on_every_rank(self) -> bool:
        """A model drafter is sharded like the target (draft TP = TP): every rank runs it, on
        the tokens the sampling rank emitted (n-gram drafts on the sampling rank alone)."""
        return self.config.method != "ngram" and get_tp_group().world_size > 1

    def _send_emitted(self, emitted: list[list[int]]) -> None:
        k = self.config.num_speculative_tokens
        rows = torch.full((len(emitted), k + 1), -1, dtype=torch.int64)
        for i, tokens in enumerate(emitted):
            rows[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        if len(emitted):
            get_tp_group().broadcast(rows.to(self.runner.device), 0)

    def _receive_emitted(self, num_reqs: int) -> list[list[int]]:
        if num_reqs == 0:
            return []
        rows = torch.empty((num_reqs, self.config.num_speculative_tokens + 1), dtype=torch.int64)
        rows = get_tp_group().broadcast(rows.to(self.runner.device), 0).cpu()
        return [[t for t in row if t >= 0] for row in rows.tolist()]

    def _verify(
        self,
        logits: torch.Tensor,
        states: list[RequestState],
        verification: _Verification,
        grammar: GrammarBitmask | None,
        sampling_req_ids: list[str],
    ) -> RejectionSamplerOutput:
        runner = self.runner
        layout = verification.layout
        metadata = verification_sampling_metadata(states, verification.drafts, logits.shape[-1], runner.device)
        if grammar is not None:
            metadata = with_token_bitmask(metadata, *self._bitmask_rows(grammar, sampling_req_ids, layout))
        flat_drafts = [t for d in verification.drafts for t in d]
        draft_token_ids = torch.tensor(flat_drafts, dtype=torch.int64).to(runner.device)
        return self.rejection_sampler(logits, layout, draft_token_ids, None, metadata)

    def _bitmask_rows(
        self, grammar: GrammarBitmask, sampling_req_ids: list[str], layout: DraftLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The bitmask on the device and its verification rows: a request's rows come in order
        (its id once per row: the grammar after 0, 1, ... of its drafts)."""
        request_index = {req_id: i for i, req_id in enumerate(sampling_req_ids)}
        num_seen: dict[str, int] = {}
        rows = np.empty(len(grammar.req_ids), dtype=np.int64)
        for row, req_id in enumerate(grammar.req_ids):
            rows[row] = layout.first_row[request_index[req_id]] + num_seen.get(req_id, 0)
            num_seen[req_id] = num_seen.get(req_id, 0) + 1
        words = np.frombuffer(grammar.bitmask, dtype=np.int32).reshape(len(grammar.req_ids), grammar.num_words)
        device = self.runner.device
        return torch.from_numpy(words.copy()).to(device), torch.from_numpy(rows).to(device)

    def _output(
        self,
        inputs: StepInputs,
        states: list[RequestState],
        verified: RejectionSamplerOutput,
        layout: DraftLayout,
        prompt_logprobs: dict[str, tuple[torch.Tensor, ...]],
        scheduler_output: SchedulerOutput,
    ) -> tuple[ModelRunnerOutput, list[list[int]]]:
        """The step's output (emitted tokens as lists, in batch order) and the sampling
        requests' emitted tokens."""
        token_rows = verified.token_ids.cpu().tolist()
        counts = verified.num_emitted.cpu().tolist()
        emitted = [row[:n] for row, n in zip(token_rows, counts)]
        by_request = dict(zip(inputs.sampling_req_ids, emitted))
        output = ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=[by_request.get(r, []) for r in inputs.req_ids],
            logprobs=_logprobs_by_request(states, verified, layout, counts),
            prompt_logprobs={
                req_id: LogprobsLists(*(t.tolist() for t in tensors)) for req_id, tensors in prompt_logprobs.items()
            },
            step_id=scheduler_output.step_id,
        )
        return output, emitted

    def _propose(
        self,
        inputs: StepInputs,
        hidden_states: torch.Tensor,
        slots: np.ndarray,
        emitted: list[list[int]],
        verification: _Verification,
    ) -> dict[str, list[int]]:
        """Write the emitted tokens into the rows (uncounted: the scheduler's next diff writes
        them) and ask the proposer for each sampling request's next drafts."""
        runner = self.runner
        batch = runner.input_batch
        model_based = self.config.method != "ngram"
        if not inputs.sampling_req_ids and not model_based:
            return {}
        sampling_slots = np.asarray(inputs.sampling_slots, dtype=np.int64)
        num_emitted = np.array([len(e) for e in emitted], dtype=np.int64)
        num_tokens = batch.num_tokens[sampling_slots] + num_emitted
        max_len = batch.token_ids.shape[1]
        for slot, tokens, start in zip(sampling_slots.tolist(), emitted, batch.num_tokens[sampling_slots].tolist()):
            tokens = tokens[: max(max_len - start, 0)]
            batch.token_ids[slot, start : start + len(tokens)] = tokens
        target = self._target_states(inputs, hidden_states, slots, emitted, verification) if model_based else None
        drafts: Drafts = self.proposer.propose(
            ProposerInputs(
                req_ids=inputs.sampling_req_ids,
                slots=sampling_slots,
                token_ids=batch.token_ids,
                num_tokens=np.minimum(num_tokens, max_len),
                target=target,
                block_table=batch.block_table,
                num_blocks=batch.num_blocks,
            )
        )
        return dict(zip(inputs.sampling_req_ids, drafts.as_lists()))

    def _target_states(
        self,
        inputs: StepInputs,
        hidden_states: torch.Tensor,
        slots: np.ndarray,
        emitted: list[list[int]],
        verification: _Verification,
    ) -> TargetStates:
        md = inputs.attn_metadata
        input_ids, positions = inputs.input_ids, inputs.positions
        if inputs.padding is not None:  # a verification graph's rows: the drafters read the real ones
            rows = self.runner._to_device(inputs.padding.token_rows)
            hidden_states, input_ids, positions = hidden_states[rows], input_ids[rows], positions[rows]
            md = self.runner.unpadded_metadata(inputs.padding)
        k = self.config.num_speculative_tokens
        emitted_ids = np.full((len(emitted), k + 1), -1, dtype=np.int64)
        for row, tokens in enumerate(emitted):
            emitted_ids[row, : len(tokens)] = tokens
        return TargetStates(
            hidden_states=hidden_states,
            input_ids=input_ids,
            positions=positions,
            query_start_loc=md.query_start_loc_cpu.numpy().astype(np.int64),
            attn_metadata=md,
            layout=verification.layout,
            emitted_token_ids=torch.from_numpy(emitted_ids),
            num_emitted=torch.tensor([len(e) for e in emitted], dtype=torch.int64),
            slots=np.asarray(slots, dtype=np.int64),
        )


def _logprobs_by_request(
    states: list[RequestState], verified: RejectionSamplerOutput, layout: DraftLayout, counts: list[int]
) -> dict[str, LogprobsLists]:
    """Each request that asked for logprobs: one row per emitted token (its layout rows)."""
    if verified.logprobs is None:
        return {}
    assert verified.logprob_token_ids is not None and verified.sampled_ranks is not None
    result = {}
    for i, state in enumerate(states):
        num_logprobs = state.sampling_params.logprobs
        if num_logprobs is None:
            continue
        first = int(layout.first_row[i])
        rows = slice(first, first + counts[i])
        lists = logprobs_lists(
            verified.logprob_token_ids[rows],
            verified.logprobs[rows],
            verified.sampled_ranks[rows],
            [num_logprobs] * counts[i],
        )
        result[state.req_id] = LogprobsLists(
            [lp.token_ids[0] for lp in lists], [lp.logprobs[0] for lp in lists], [lp.ranks[0] for lp in lists]
        )
    return result
