"""Beam search on top of the engine, as vLLM runs it: no engine change, one round per token.

Each round, every live beam of every prompt is one engine request (its prompt: the prompt and
the beam's tokens so far) that generates one token with the `2 * beam_width` most likely next
tokens' logprobs; prefix caching keeps the cost of re-sending the beams down to about a block
per beam and round. `BeamSearch` is one prompt's search; `LLM.beam_search` and
`AsyncLLM.beam_search` drive the rounds with their engines.

A round, as Hugging Face transformers' beam search takes it: the candidates are every live
beam extended by each of its top tokens, ranked by cumulative logprob. Among the best
`beam_width` candidates, those that end (eos, unless `ignore_eos`, or `max_tokens`, capped by
the context) finish with the score `cum_logprob / num_tokens ** length_penalty` (their generated
tokens, eos included); the best `beam_width` candidates that do not end live on. The search
stops when no beam lives, or when no live beam could still score above the `beam_width`-th
finished one (an exact bound: the result is that of running to `max_tokens`, transformers'
`early_stopping="never"`). The output is the best `beam_width` finished beams, best first.

Where vLLM differs: it finishes every eos candidate of every beam's top tokens (not only those
among the round's best), and its length counts the prompt and not the eos. With
`beam_width=1` shoal's search is greedy decoding, eos included.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from shoal.frontend.detokenizer import IncrementalDetokenizer
from shoal.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from shoal.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """A finished beam, as vLLM returns it: `tokens` holds the prompt's tokens and the
    generated ones, `text` the generated text (without its eos)."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]  # per generated token: the candidates it was chosen among
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (eos) | "length"
    stop_reason: int | str | None = None
    score: float = 0.0  # cum_logprob with the length penalty: what the beams are sorted by


@dataclass
class BeamSearchOutput:
    """One prompt's best beams, best first (vLLM's name)."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    token_ids: list[int] = field(default_factory=list)  # generated
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    score: float = 0.0


def step_params(params: BeamSearchParams) -> SamplingParams:
    """What each beam's one-token request asks the engine for."""
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        logprobs=2 * params.beam_width,
        ignore_eos=True,  # an eos is one candidate among the others
        skip_special_tokens=False,
    )


class BeamSearch:
    """One prompt's search. `prompts()` are the requests of the next round, one per live beam;
    `advance(rows)` takes each one's logprobs row; `done` once the search is over."""

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        eos_token_ids: Collection[int],
        max_model_len: int,
    ) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.max_tokens = min(params.max_tokens, max_model_len - len(prompt_token_ids))
        self.live = [_Beam()]
        self.finished: list[_Beam] = []

    @property
    def done(self) -> bool:
        return not self.live

    def prompts(self) -> list[list[int]]:
        return [self.prompt_token_ids + beam.token_ids for beam in self.live]

    def score(self, cum_logprob: float, num_tokens: int) -> float:
        return cum_logprob / num_tokens**self.params.length_penalty

    def advance(self, rows: list[PositionLogprobs]) -> None:
        """One round: `rows[i]` is the next-token logprobs of `self.live[i]`."""
        width = self.params.beam_width
        num_tokens = len(self.live[0].token_ids) + 1
        candidates = [
            (beam.cum_logprob + logprob.logprob, beam, token_id, row)
            for beam, row in zip(self.live, rows, strict=True)
            for token_id, logprob in _top(row, 2 * width)
        ]
        candidates.sort(key=lambda candidate: -candidate[0])
        live = []
        for rank, (cum_logprob, beam, token_id, row) in enumerate(candidates[: 2 * width]):
            ends_with_eos = token_id in self.eos_token_ids
            ends = ends_with_eos or num_tokens >= self.max_tokens
            extended = _Beam([*beam.token_ids, token_id], [*beam.logprobs, row], cum_logprob)
            if ends and rank < width:
                extended.finish_reason = "stop" if ends_with_eos else "length"
                extended.score = self.score(cum_logprob, num_tokens)
                self.finished.append(extended)
            elif not ends and len(live) < width:
                live.append(extended)
        self.live = [] if self._cannot_improve(live, num_tokens) else live

    def _cannot_improve(self, live: list[_Beam], num_tokens: int) -> bool:
        """No live beam can end above the `beam_width`-th finished one: a beam's logprob only
        falls, so its best possible score is at its longest length (a positive length
        penalty) or at its next token (otherwise)."""
        width = self.params.beam_width
        if not live or len(self.finished) < width:
            return False
        worst_kept = sorted((b.score for b in self.finished), reverse=True)[width - 1]
        best_length = self.max_tokens if self.params.length_penalty > 0 else num_tokens + 1
        return all(self.score(beam.cum_logprob, best_length) <= worst_kept for beam in live)

    def best(self) -> list[_Beam]:
        """The best `beam_width` finished beams, best first (the search must be done)."""
        assert self.done
        return sorted(self.finished, key=lambda beam: -beam.score)[: self.params.beam_width]

    # ---- results -------------------------------------------------------------------------------

    def output(self, tokenizer: Any) -> BeamSearchOutput:
        """`LLM.beam_search`'s result for this prompt."""
        return BeamSearchOutput(
            [
                BeamSearchSequence(
                    tokens=self.prompt_token_ids + beam.token_ids,
                    logprobs=beam.logprobs,
                    cum_logprob=beam.cum_logprob,
                    text=self.text(beam, tokenizer),
                    finish_reason=beam.finish_reason,
                    score=beam.score,
                )
                for beam in self.best()
            ]
        )

    def request_output(self, request_id: str, prompt: str | None, tokenizer: Any) -> RequestOutput:
        """`AsyncLLM.beam_search`'s result: the beams as completions, best first."""
        completions = [
            CompletionOutput(
                index=index,
                text=self.text(beam, tokenizer) or "",
                token_ids=beam.token_ids,
                cumulative_logprob=beam.cum_logprob,
                logprobs=beam.logprobs,
                finish_reason=beam.finish_reason,
            )
            for index, beam in enumerate(self.best())
        ]
        return RequestOutput(request_id, prompt, self.prompt_token_ids, completions, finished=True)

    def text(self, beam: _Beam, tokenizer: Any) -> str | None:
        """The beam's text as `generate` writes it (the same detokenizer; no eos)."""
        if tokenizer is None:
            return None
        params = SamplingParams(include_stop_str_in_output=self.params.include_stop_str_in_output)
        detokenizer = IncrementalDetokenizer(tokenizer, self.prompt_token_ids, params)
        detokenizer.update(beam.token_ids, stop_terminated=beam.finish_reason == "stop", finished=True)
        return detokenizer.output_text


def _top(row: PositionLogprobs, k: int) -> list[tuple[int, Any]]:
    return sorted(row.items(), key=lambda item: -item[1].logprob)[:k]


def top_completions(output: RequestOutput, n: int, num_logprobs: int | None) -> RequestOutput:
    """The best `n` beams of `output`, each position's logprobs cut to the chosen token and the
    `num_logprobs` most likely (None: no logprobs), as a request for `n` completions with
    `logprobs` gets them."""
    completions = []
    for completion in output.outputs[:n]:
        logprobs = None
        if num_logprobs is not None:
            logprobs = [
                {t: lp for t, lp in row.items() if t == token_id or lp.rank <= num_logprobs}
                for token_id, row in zip(completion.token_ids, completion.logprobs or [])
            ]
        completions.append(replace(completion, logprobs=logprobs))
    return replace(output, outputs=completions)
