"""`OutputProcessor`: turns the engine core's token ids into `RequestOutput`s.

It detokenizes incrementally, applies stop strings (a hit finishes the request here and asks
the core to abort it), formats logprobs, joins the `n` child requests of a prompt back into one
`RequestOutput`, and says which weight version sampled which tokens (`weight_versions`: each
completion remembers where a new version started; spans are built only for the outputs made).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from shoal.frontend.detokenizer import IncrementalDetokenizer
from shoal.frontend.routed_experts import RoutedExpertsBuffer
from shoal.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput, WeightVersionSpan
from shoal.protocol import EngineCoreOutput
from shoal.sampling_params import SamplingParams, offset_seed
from shoal.step import LogprobsLists


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every output carries everything so far
    DELTA = "delta"  # every output carries only what is new (streaming)
    FINAL_ONLY = "final_only"  # one output per prompt, when all its completions are done


@dataclass
class ParentRequest:
    """A prompt as the user sent it, with its `n` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: OutputKind
    completions: list[CompletionOutput]
    child_ids: list[str]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    num_finished: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.completions)


class WeightVersions:
    """Where each weight version starts in one completion's tokens, and its spans on demand."""

    __slots__ = ("cached_length", "cached_spans", "starts", "version")

    def __init__(self) -> None:
        self.version: str | None = None  # the version of the latest tokens
        self.starts: list[tuple[str, int]] = []  # (version, index of its first token), in order
        # While one version made every token, the spans depend on their number only (a stream's
        # outputs are mostly one token each): the last ones, for that many tokens (-1: none).
        self.cached_length = -1
        self.cached_spans: tuple[WeightVersionSpan, ...] = ()

    def start(self, version: str, index: int) -> None:
        """Tokens from `index` on were sampled with `version`."""
        self.version = version
        self.starts.append((version, index))
        self.cached_length = -1

    def spans(self, first: int, end: int) -> tuple[WeightVersionSpan, ...]:
        """The spans of tokens first..end (exclusive), as indices from `first`."""
        if end - first == self.cached_length:
            return self.cached_spans
        starts = self.starts
        spans = []
        for i, (version, start) in enumerate(starts):
            stop = starts[i + 1][1] if i + 1 < len(starts) else end
            lo, hi = max(start, first), min(stop, end)
            if lo < hi:
                spans.append(WeightVersionSpan(version, lo - first, hi - first))
        if len(starts) == 1 and starts[0][1] == 0:
            self.cached_length, self.cached_spans = end - first, tuple(spans)
        return tuple(spans)


@dataclass
class ChildState:
    parent: ParentRequest
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    weight_versions: WeightVersions = field(default_factory=WeightVersions)
    routed_experts: RoutedExpertsBuffer | None = None  # when the request asked for them


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Child requests that finished here (stop strings) and must be aborted in the core.
    reqs_to_abort: list[str]


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each of the n completions samples on its own; with a seed, completion i uses seed + i."""
    changes: dict[str, Any] = {"n": 1}
    if params.seed is not None and index:
        changes["seed"] = offset_seed(params.seed, index)
    return params.clone(**changes)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.children: dict[str, ChildState] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
    ) -> list[tuple[str, SamplingParams]]:
        """Register a prompt; returns the (child request id, params) pairs to send to the core."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        child_ids = child_request_ids(request_id, params.n)
        parent = ParentRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            output_kind=output_kind,
            completions=[CompletionOutput(index=i, text="", token_ids=[]) for i in range(params.n)],
            child_ids=child_ids,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        self.parents[request_id] = parent
        children = []
        for index, child_id in enumerate(child_ids):
            child_params = child_sampling_params(params, index)
            if params.logprobs is not None:
                parent.completions[index].logprobs = []
                parent.completions[index].cumulative_logprob = 0.0
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child_params)
            self.children[child_id] = ChildState(parent, index, child_params, detokenizer)
            if params.return_routed_experts:
                self.children[child_id].routed_experts = RoutedExpertsBuffer()
            children.append((child_id, child_params))
        return children

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a prompt; returns its unfinished child ids for the core to abort."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        for child_id in parent.child_ids:
            self.children.pop(child_id, None)
        return [c for i, c in enumerate(parent.child_ids) if parent.completions[i].finish_reason is None]

    def process_outputs(self, outputs: list[EngineCoreOutput], weight_version: str | None = None) -> ProcessedOutputs:
        """Apply one step's outputs; `weight_version` is the version that step ran with."""
        request_outputs = []
        reqs_to_abort = []
        for output in outputs:
            child = self.children.get(output.request_id)
            if child is None:
                continue  # aborted by the user while the step ran
            stopped_by_string = self._update_child(child, output, weight_version)
            if stopped_by_string and not output.finished:
                reqs_to_abort.append(output.request_id)
            request_output = self._make_request_output(child)
            if request_output is not None:
                request_outputs.append(request_output)
        return ProcessedOutputs(request_outputs, reqs_to_abort)

    def _update_child(self, child: ChildState, output: EngineCoreOutput, weight_version: str | None) -> bool:
        """Apply one engine output to a completion; True when a stop string ended it."""
        parent = child.parent
        completion = parent.completions[child.index]
        versions = child.weight_versions
        if weight_version != versions.version and weight_version is not None and output.new_token_ids:
            versions.start(weight_version, len(completion.token_ids))
        completion.token_ids.extend(output.new_token_ids)
        parent.num_cached_tokens = output.num_cached_tokens
        if output.new_prompt_logprobs is not None and parent.prompt_logprobs is not None and child.index == 0:
            parent.prompt_logprobs.extend(self._format_logprobs(output.new_prompt_logprobs))
        if output.new_logprobs is not None and completion.logprobs is not None:
            completion.logprobs.extend(self._format_logprobs(output.new_logprobs))
            completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sum(
                row[0] for row in output.new_logprobs.logprobs
            )
        if output.new_routed_experts is not None and child.routed_experts is not None:
            child.routed_experts.write(output.new_routed_experts)
        # The core finishes with "stop" only on eos or a stop token id (stop strings are ours).
        stop_terminated = output.finish_reason == "stop"
        stop_string = child.detokenizer.update(
            output.new_token_ids, stop_terminated, finished=output.finish_reason is not None
        )
        completion.text = child.detokenizer.output_text
        if child.detokenizer.num_tokens_after_stop:
            self._drop_tokens_after_stop(completion, output, child.detokenizer.num_tokens_after_stop)
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        if stop_string is not None:
            finish_reason, stop_reason = "stop", stop_string
        if finish_reason is not None:
            completion.finish_reason, completion.stop_reason = finish_reason, stop_reason
            completion.weight_versions = versions.spans(0, len(completion.token_ids))
            completion.routed_experts = child.routed_experts.array() if child.routed_experts else None
            parent.num_finished += 1
            self.children.pop(output.request_id, None)
            if parent.finished:
                del self.parents[parent.request_id]
        return stop_string is not None

    @staticmethod
    def _drop_tokens_after_stop(completion: CompletionOutput, output: EngineCoreOutput, num_tokens: int) -> None:
        """The tokens of one output after the one that completed a stop string (speculative
        decoding emits several at once), with their logprobs."""
        del completion.token_ids[-num_tokens:]
        if output.new_logprobs is not None and completion.logprobs is not None:
            del completion.logprobs[-num_tokens:]
            dropped = sum(row[0] for row in output.new_logprobs.logprobs[-num_tokens:])
            completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) - dropped

    def _make_request_output(self, child: ChildState) -> RequestOutput | None:
        parent = child.parent
        if parent.output_kind == OutputKind.FINAL_ONLY:
            if not parent.finished:
                return None
            completions = parent.completions
        elif parent.output_kind == OutputKind.DELTA:
            completions = [self._delta(child)]
        else:
            completion = parent.completions[child.index]
            completion.weight_versions = child.weight_versions.spans(0, len(completion.token_ids))
            if child.routed_experts is not None:
                completion.routed_experts = child.routed_experts.array()
            completions = [completion]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=parent.finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
        )

    def _delta(self, child: ChildState) -> CompletionOutput:
        """What is new in a completion since it was last streamed."""
        full = child.parent.completions[child.index]
        finished = full.finish_reason is not None
        versions, first, end = child.weight_versions, child.num_sent_tokens, len(full.token_ids)
        # The cached spans without a call: every streamed token takes this path.
        spans = versions.cached_spans if end - first == versions.cached_length else versions.spans(first, end)
        delta = CompletionOutput(
            index=full.index,
            text=child.detokenizer.text_delta(finished),
            token_ids=full.token_ids[child.num_sent_tokens :],
            cumulative_logprob=full.cumulative_logprob,
            logprobs=full.logprobs[child.num_sent_logprobs :] if full.logprobs is not None else None,
            finish_reason=full.finish_reason,
            stop_reason=full.stop_reason,
            weight_versions=spans,
            # The whole array so far (positions are not a completion's tokens).
            routed_experts=child.routed_experts.array() if child.routed_experts else None,
        )
        child.num_sent_tokens = len(full.token_ids)
        child.num_sent_logprobs = len(full.logprobs or ())
        return delta

    def _format_logprobs(self, lists: LogprobsLists) -> list[PositionLogprobs]:
        rows = []
        for token_ids, logprobs, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            row: PositionLogprobs = {}
            for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
                if token_id not in row:
                    # The actual token has its true rank; the top-N are ranked 1..N.
                    row[token_id] = Logprob(logprob, rank if i == 0 else i, self._decode(token_id))
            rows.append(row)
        return rows

    def _decode(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None
