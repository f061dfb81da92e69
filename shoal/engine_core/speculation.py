"""`SpeculativeScheduling`: the scheduler's side of speculative decoding (docs/spec_decode.md).

A running request carries the drafts its last step proposed (`Request.spec_token_ids`). When it
decodes, the scheduler schedules its last token and up to n of those drafts: n cut to the step's
token budget, to `max_model_len` (the last draft's position must exist) and to what `max_tokens`
still allows (a step emits at most n + 1 tokens). All 1 + n count in the budget and get KV slots.
When the step comes back, the request emits 1 + accepted tokens; its `num_computed_tokens`
advanced by 1 + n when scheduled and is taken back by the rejected drafts, so they are never
counted (their KV entries are overwritten when the positions are next written) and never reach
the prefix cache (which registers only blocks of known tokens).

Speculation is off for a whole step above `disable_by_batch_size` running requests, and off for
a request whose drafts are mostly rejected: below `MIN_ACCEPTANCE_RATE` accepted tokens per
draft token (a running average) a request decodes plainly for `PROBATION_TOKENS` output tokens,
then drafts again. Model drafters write KV past a request's tokens (their chain of drafts), so
the scheduler allocates `num_lookahead_slots` more slots than a step computes.

This module imports no torch. Its cumulative counts (`spec_decoding_stats`, in the engine core's
`get_stats`) feed vLLM's `spec_decode_*` metrics and the stats log line.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shoal.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from shoal.engine_core.request import Request
    from shoal.step import ModelRunnerOutput

__all__ = ["SpeculativeConfig", "SpeculativeScheduling"]

# Below this many accepted tokens per draft token a draft costs more than it saves (a verified
# draft costs about a decode token's share of the forward; one accepted in ten does not pay).
MIN_ACCEPTANCE_RATE = 0.1
# Draft tokens a request must have had verified before its rate is judged.
MIN_DRAFT_TOKENS_JUDGED = 8
# Output tokens a request decodes without drafts once its rate is too low.
PROBATION_TOKENS = 32
# Weight of the newest step in a request's running acceptance rate.
RATE_DECAY = 0.2


@dataclass
class _Acceptance:
    """One request's running acceptance rate, and until when its speculation is off."""

    rate: float = 1.0
    num_draft_tokens: int = 0
    off_until_num_output_tokens: int = 0


@dataclass
class _Counts:
    """Cumulative counts (vLLM's spec_decode_* counters): verifications of a request's drafts,
    their draft tokens, the accepted ones, and the accepted ones by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class SpeculativeScheduling:
    """Mixed into `Scheduler`: which drafts a step carries, and what its output does to them."""

    max_model_len: int
    running: list[Request]

    def _init_speculation(self, config: SpeculativeConfig | None) -> None:
        self.speculative_config = config
        k = config.num_speculative_tokens if config is not None else 0
        # A model drafter's chain writes its KV at the k positions after a request's last token.
        self.num_lookahead_slots = k if config is not None and config.method != "ngram" else 0
        self._acceptance: weakref.WeakKeyDictionary[Request, _Acceptance] = weakref.WeakKeyDictionary()
        self._spec_counts = _Counts(num_accepted_tokens_per_pos=[0] * k)

    def _drafts_to_schedule(self, request: Request, num_new_tokens: int, budget: int) -> list[int]:
        """The drafts `request` carries into this step: none unless it decodes (its one new token
        is its last), speculation is on for the step and for it; cut to the budget left after its
        token, to max_model_len and to the tokens max_tokens still allows."""
        drafts = request.spec_token_ids
        config = self.speculative_config
        if not drafts or config is None or num_new_tokens != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return []
        if not config.speculates_at(len(self.running)):
            return []
        acceptance = self._acceptance.get(request)
        if acceptance is not None and request.num_output_tokens < acceptance.off_until_num_output_tokens:
            return []
        n = min(
            len(drafts),
            budget - 1,
            self.max_model_len - request.num_tokens,
            request.max_tokens - request.num_output_tokens - 1,
        )
        drafts = drafts[: max(n, 0)]
        if request.structured_output is not None and drafts:  # cut where the grammar refuses
            from shoal.structured_output.manager import StructuredOutputManager

            drafts = StructuredOutputManager.accepted_prefix(request, drafts)
        return drafts

    def _append_emitted(
        self, request: Request, token_ids: list[int], scheduled_drafts: list[int] | None
    ) -> tuple[list[int], bool]:
        """Append a step's emitted tokens (one, or accepted drafts and one more) one at a time,
        each checked for a stop (eos, stop ids, max_tokens, max_model_len end the run inside
        it; the rest is dropped). Returns the tokens appended and whether the request finished."""
        if token_ids:
            request.num_output_placeholders -= 1
            self._settle_drafts(request, scheduled_drafts, len(token_ids))
        new_token_ids = []
        for token_id in token_ids:
            request.append_output_token_id(token_id)
            new_token_ids.append(token_id)
            if request.check_stop(self.max_model_len):
                return new_token_ids, True
        return new_token_ids, False

    def _settle_drafts(self, request: Request, scheduled_drafts: list[int] | None, num_emitted: int) -> None:
        """The step verified `scheduled_drafts` and emitted `num_emitted` tokens (accepted + 1):
        the rejected drafts are taken back from `num_computed_tokens`; the counts and the
        request's acceptance rate take the step in."""
        request.spec_token_ids = []
        if not scheduled_drafts or num_emitted == 0:
            return
        num_drafts, num_accepted = len(scheduled_drafts), num_emitted - 1
        request.num_computed_tokens -= num_drafts - num_accepted
        counts = self._spec_counts
        counts.num_drafts += 1
        counts.num_draft_tokens += num_drafts
        counts.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            counts.num_accepted_tokens_per_pos[pos] += 1
        self._judge_acceptance(request, num_drafts, num_accepted)

    def _judge_acceptance(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        acceptance = self._acceptance.setdefault(request, _Acceptance())
        acceptance.rate += RATE_DECAY * (num_accepted / num_drafts - acceptance.rate)
        acceptance.num_draft_tokens += num_drafts
        if acceptance.num_draft_tokens >= MIN_DRAFT_TOKENS_JUDGED and acceptance.rate < MIN_ACCEPTANCE_RATE:
            # Off for a while, then judged afresh.
            self._acceptance[request] = _Acceptance(
                off_until_num_output_tokens=request.num_output_tokens + num_accepted + 1 + PROBATION_TOKENS
            )

    def _take_new_drafts(self, model_output: ModelRunnerOutput, scheduled: dict[str, Request]) -> None:
        """The drafts the workers proposed for the requests' next step."""
        if not model_output.spec_token_ids:
            return
        for request_id, drafts in zip(model_output.req_ids, model_output.spec_token_ids, strict=True):
            request = scheduled.get(request_id)
            if request is not None and not request.is_finished:
                request.spec_token_ids = drafts

    def spec_decoding_stats(self) -> dict[str, int | list[int]]:
        """The cumulative counts, by their metric names (empty without speculation)."""
        if self.speculative_config is None:
            return {}
        counts = self._spec_counts
        return {
            "spec_decode_num_drafts": counts.num_drafts,
            "spec_decode_num_draft_tokens": counts.num_draft_tokens,
            "spec_decode_num_accepted_tokens": counts.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(counts.num_accepted_tokens_per_pos),
        }
