"""`RejectionSampler`: from the target's logits at each request's draft and bonus positions to the
tokens a step emits, with the target's own output distribution (Leviathan et al., 2023, "Fast
Inference from Transformers via Speculative Decoding"; Chen et al., 2023, "Accelerating Large
Language Model Decoding with Speculative Sampling").

Per request with drafts d_0..d_{n-1} and logits rows 0..n (`DraftLayout`):
- greedy rows accept d_j while it is the argmax of row j, then emit the argmax of the first row
  that refused (or of row n, the bonus, when all were accepted);
- sampled rows accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), p_j the target's
  distribution at row j, q_j the draft's; at the first rejection they emit a token drawn from
  normalize(max(p_j - q_j, 0)); when all n are accepted, a bonus token drawn from p_n. Each
  emitted token is then distributed as p, whatever q was.
- Without the draft's probabilities (n-gram lookup; a model drafting greedily) the draft is a
  point mass at d_j: acceptance with probability p_j(d_j), the residual is p_j without d_j.

p is the distribution the normal sampler draws from: the grammar's bitmask, penalties,
logit_bias and min_tokens (`processed_logits`), then temperature, top-k, top-p and min-p
(`processed_probs`), from shoal/workers/sampler.py, on rows whose metadata counts the drafts
before them as output (`verification_sampling_metadata`). Logprobs are the raw logits' (after the
bitmask), as the normal sampler's are.

Randomness: a request with a seed draws from its own generator, its n acceptance uniforms first,
then the noise of its one emitted sample, so its tokens do not depend on what else is batched.
The emitted sample uses the exponential race (argmax of r / E, E ~ Exp(1)) over the unnormalized
residual r, as the sampler does. No host synchronization: the layout's index arrays are on the
host already (the scheduler knows the draft counts), everything else stays on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from shoal.spec_decode.draft_layout import DraftLayout
from shoal.workers.input_batch import RequestState
from shoal.workers.sampler import (
    SamplerOutput,
    SamplingMetadata,
    apply_token_bitmask,
    build_sampling_metadata,
    gather_logprobs,
    processed_logits,
    processed_probs,
)


@dataclass
class RejectionSamplerOutput:
    # [num_reqs, k + 1] int64: each request's accepted drafts, then its corrected or bonus
    # token; -1 after them.
    token_ids: torch.Tensor
    num_emitted: torch.Tensor  # [num_reqs] int64: accepted drafts + 1
    # By logits row (the layout's rows; None unless a request wants logprobs): the token row j
    # of a request emitted (its j-th token), the top-N, and its rank. A request's rows past its
    # emitted tokens hold the logprobs of token 0, to be dropped.
    logprob_token_ids: torch.Tensor | None = None  # [num_rows, 1 + N]
    logprobs: torch.Tensor | None = None  # [num_rows, 1 + N]
    sampled_ranks: torch.Tensor | None = None  # [num_rows]

    @property
    def num_accepted(self) -> torch.Tensor:
        return self.num_emitted - 1


def verification_sampling_metadata(
    states: list[RequestState], draft_token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """The sampling metadata of the verification rows (`DraftLayout` order): request i's row j
    samples as if it had already emitted its drafts 0..j-1, which it has whenever row j is
    used, so penalties and min_tokens count them; every row of a seeded request carries its
    generator."""
    rows: list[RequestState] = []
    for state, drafts in zip(states, draft_token_ids):
        rows.append(state)
        for j in range(1, len(drafts) + 1):
            if state.reads_output_tokens:
                rows.append(dataclasses.replace(state, output_token_ids=state.output_token_ids + list(drafts[:j])))
            else:  # its output tokens are not kept, nor read: the row samples as the request does
                rows.append(state)
    return build_sampling_metadata(rows, vocab_size, device)


class RejectionSampler(torch.nn.Module):
    """Verifies up to `num_speculative_tokens` drafts a request. `accept_all_drafts` (benchmarks
    only) accepts every draft unverified and samples the bonus token: the output is not the
    target's, it prices the verification forward alone."""

    def __init__(self, num_speculative_tokens: int, accept_all_drafts: bool = False) -> None:
        super().__init__()
        self.num_speculative_tokens = num_speculative_tokens
        self.accept_all_drafts = accept_all_drafts

    def forward(
        self,
        logits: torch.Tensor,
        layout: DraftLayout,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        metadata: SamplingMetadata,
    ) -> RejectionSamplerOutput:
        """`logits` [num_rows, vocab] (the layout's rows), `draft_token_ids` [num_drafts] and
        `draft_probs` [num_drafts, vocab] (None: point masses) in flattened draft order,
        `metadata` by row (`verification_sampling_metadata`)."""
        self._check_shapes(logits, layout, draft_token_ids, draft_probs)
        index = _DeviceIndex(layout, logits.device)
        draft_token_ids = draft_token_ids.long()  # gathers and scatters index with int64
        if metadata.token_bitmask is not None:
            logits = apply_token_bitmask(logits, metadata.token_bitmask, metadata.bitmask_rows)
        logits = logits.float()  # [num_rows, vocab]
        raw_logprobs = logits.log_softmax(dim=-1) if metadata.max_num_logprobs >= 0 else None
        logits = processed_logits(logits, metadata)
        argmax = logits.argmax(dim=-1) if metadata.any_greedy else None  # [num_rows]
        probs = None if metadata.all_greedy else processed_probs(logits, metadata)
        uniforms, noise = self._draws(layout, metadata, logits.shape[-1], logits.device)

        accepted = self._accepted(index, draft_token_ids, draft_probs, metadata, argmax, probs, uniforms)
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [num_reqs] leading accepted drafts
        final = self._final_tokens(index, num_accepted, draft_token_ids, draft_probs, metadata, argmax, probs, noise)
        token_ids = self._emitted(index, num_accepted, draft_token_ids, final)
        output = RejectionSamplerOutput(token_ids=token_ids, num_emitted=num_accepted + 1)
        if raw_logprobs is not None:
            self._gather_logprobs(output, index, raw_logprobs, metadata.max_num_logprobs)
        return output

    def _check_shapes(
        self, logits: torch.Tensor, layout: DraftLayout, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None
    ) -> None:
        if layout.num_reqs and int(layout.num_draft_tokens.max()) > self.num_speculative_tokens:
            raise ValueError(f"a request carries more than num_speculative_tokens={self.num_speculative_tokens} drafts")
        if logits.shape[0] != layout.num_rows or draft_token_ids.shape != (layout.num_drafts,):
            raise ValueError(
                f"{layout.num_reqs} requests with {layout.num_drafts} drafts need {layout.num_rows} logits rows and "
                f"{layout.num_drafts} draft ids, got {logits.shape[0]} rows and {tuple(draft_token_ids.shape)} ids"
            )
        if draft_probs is not None and draft_probs.shape != (layout.num_drafts, logits.shape[-1]):
            raise ValueError(f"draft_probs must be [num_drafts, vocab], got {tuple(draft_probs.shape)}")

    def _draws(
        self, layout: DraftLayout, md: SamplingMetadata, vocab_size: int, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The acceptance uniforms [num_drafts] (None when none is tested: all greedy, or every
        draft accepted) and the noise of each request's emitted sample [num_reqs, vocab] (None
        when all rows are greedy). A seeded request's come from its generator: its uniforms,
        then its noise row."""
        if md.all_greedy:
            return None, None
        uniforms = None if self.accept_all_drafts else torch.rand(layout.num_drafts, device=device)
        noise = torch.empty(layout.num_reqs, vocab_size, device=device).exponential_()
        for req, generator in _request_generators(layout, md).items():
            first, n = int(layout.first_draft[req]), int(layout.num_draft_tokens[req])
            if uniforms is not None and n:
                uniforms[first : first + n] = torch.rand(n, generator=generator, device=device)
            noise[req].exponential_(generator=generator)
        return uniforms, noise

    def _accepted(
        self,
        index: _DeviceIndex,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        md: SamplingMetadata,
        argmax: torch.Tensor | None,
        probs: torch.Tensor | None,
        uniforms: torch.Tensor | None,
    ) -> torch.Tensor:
        """[num_reqs, k] whether each draft is accepted on its own (False past a request's
        drafts); a request keeps the leading run."""
        if self.accept_all_drafts:
            draft_ok = torch.ones_like(draft_token_ids, dtype=torch.bool)
        else:
            draft_ok = self._greedy_and_random(index, draft_token_ids, draft_probs, md, argmax, probs, uniforms)
        accepted = torch.zeros(
            index.num_reqs, self.num_speculative_tokens, dtype=torch.bool, device=draft_token_ids.device
        )
        accepted[index.draft_req, index.draft_pos] = draft_ok
        return accepted

    @staticmethod
    def _greedy_and_random(
        index: _DeviceIndex,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        md: SamplingMetadata,
        argmax: torch.Tensor | None,
        probs: torch.Tensor | None,
        uniforms: torch.Tensor | None,
    ) -> torch.Tensor:
        """[num_drafts]: greedy rows, the draft is the row's argmax; sampled rows, u < p(d) / q(d)
        (as u * q(d) < p(d): never for p(d) = 0, always for p(d) >= q(d))."""
        rows = index.draft_rows
        greedy_ok = argmax[rows] == draft_token_ids if argmax is not None else None
        if probs is None:
            assert greedy_ok is not None
            return greedy_ok
        assert uniforms is not None
        p = probs[rows, draft_token_ids]  # [num_drafts]
        if draft_probs is None:
            random_ok = uniforms < p
        else:
            q = draft_probs.gather(1, draft_token_ids[:, None]).squeeze(1).float()
            random_ok = uniforms * q < p
        if greedy_ok is None:
            return random_ok
        return torch.where(md.greedy[rows], greedy_ok, random_ok)

    def _final_tokens(
        self,
        index: _DeviceIndex,
        num_accepted: torch.Tensor,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        md: SamplingMetadata,
        argmax: torch.Tensor | None,
        probs: torch.Tensor | None,
        noise: torch.Tensor | None,
    ) -> torch.Tensor:
        """[num_reqs] each request's last emitted token, from the row after its accepted drafts:
        the argmax on greedy rows; on sampled rows a draw from the residual where that row's
        draft was rejected, from p at the bonus row."""
        final_rows = index.first_row + num_accepted  # [num_reqs]
        greedy_final = argmax[final_rows] if argmax is not None else None
        if probs is None:
            assert greedy_final is not None
            return greedy_final
        assert noise is not None
        target = probs[final_rows]  # [num_reqs, vocab]
        rejected = num_accepted < index.num_draft_tokens
        if index.num_drafts and not self.accept_all_drafts:
            # The rejected draft's flat index (clamped where nothing was rejected: masked below).
            rejected_draft = (index.first_draft + num_accepted).clamp(max=index.num_drafts - 1)
            if draft_probs is None:  # a point mass: p without the draft
                residual = target.scatter(1, draft_token_ids[rejected_draft][:, None], 0.0)
            else:
                residual = (target - draft_probs[rejected_draft].float()).clamp_(min=0.0)
            # Exact arithmetic leaves mass where a draft was rejected (some token has p > q);
            # rounding could leave none, and then p itself is the safe draw.
            usable = rejected & (residual.sum(dim=-1) > 0)
            target = torch.where(usable[:, None], residual, target)
        sampled = target.div(noise).argmax(dim=-1)
        if greedy_final is None:
            return sampled
        return torch.where(md.greedy[final_rows], greedy_final, sampled)

    def _emitted(
        self, index: _DeviceIndex, num_accepted: torch.Tensor, draft_token_ids: torch.Tensor, final: torch.Tensor
    ) -> torch.Tensor:
        """[num_reqs, k + 1]: the accepted drafts, the final token at column num_accepted, -1 after."""
        width = self.num_speculative_tokens + 1
        padded = torch.full((index.num_reqs, width), -1, dtype=torch.int64, device=final.device)
        padded[index.draft_req, index.draft_pos] = draft_token_ids.long()
        columns = torch.arange(width, device=final.device)
        token_ids = torch.where(columns < num_accepted[:, None], padded, -1)
        return token_ids.scatter_(1, num_accepted[:, None], final[:, None].long())

    @staticmethod
    def _gather_logprobs(
        output: RejectionSamplerOutput, index: _DeviceIndex, raw_logprobs: torch.Tensor, num_logprobs: int
    ) -> None:
        """Logprobs by row of the token each row emitted (row j of a request: its token j)."""
        row_tokens = output.token_ids[index.row_req, index.row_pos].clamp(min=0)  # [num_rows]
        rows = SamplerOutput(sampled_token_ids=row_tokens)
        gather_logprobs(rows, raw_logprobs, row_tokens, num_logprobs)
        output.logprob_token_ids, output.logprobs, output.sampled_ranks = (
            rows.logprob_token_ids,
            rows.logprobs,
            rows.sampled_ranks,
        )


class _DeviceIndex:
    """A `DraftLayout`'s index arrays on the device, packed into one host array and copied at
    once (one copy costs about what each of eight small ones would)."""

    def __init__(self, layout: DraftLayout, device: torch.device) -> None:
        row_req = layout.row_req
        arrays = [
            layout.num_draft_tokens,
            layout.first_row,
            layout.first_draft,
            layout.draft_req,
            layout.draft_pos,
            layout.draft_rows,
            row_req,
            np.arange(layout.num_rows) - layout.first_row[row_req],  # each row's index in its request
        ]
        packed = torch.from_numpy(np.concatenate(arrays).astype(np.int64)).to(device, non_blocking=True)
        views = packed.split([len(a) for a in arrays])
        self.num_draft_tokens, self.first_row, self.first_draft = views[0], views[1], views[2]
        self.draft_req, self.draft_pos, self.draft_rows, self.row_req, self.row_pos = views[3:]
        self.num_reqs, self.num_drafts = layout.num_reqs, layout.num_drafts


def _request_generators(layout: DraftLayout, md: SamplingMetadata) -> dict[int, torch.Generator]:
    """The generator of each seeded request, read at its first row (every row of a request carries
    the same one)."""
    if not md.generators:
        return {}
    request_of_first_row = {int(row): req for req, row in enumerate(layout.first_row)}
    return {request_of_first_row[row]: g for row, g in md.generators.items() if row in request_of_first_row}
