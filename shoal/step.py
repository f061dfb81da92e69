"""What one engine step sends to the workers (`SchedulerOutput`) and gets back
(`ModelRunnerOutput`).

Workers keep a persistent copy of every running request, so the scheduler sends diffs: a
request's full state once (`NewRequestData`), then only what changed (`CachedRequestData`).
These are msgspec structs so the executor can serialize a step once for all workers, and frozen:
a step is what the scheduler built, and nothing changes it on its way (what a step's structured
rows need, the scheduler decides as it builds the step: see `SchedulerOutput.grammar_follows`).

This module sits beside `protocol.py` (what crosses the frontend ↔ engine-core boundary): the
workers and executors import it, never the engine core.
"""

from __future__ import annotations

import msgspec

from shoal.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """A request the workers have not seen (or must rebuild after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # The sampler keeps eos (and stop tokens) from being sampled before min_tokens.
    eos_token_id: int | None = None
    # The LoRA adapter the request runs with (None: the base model): shoal/lora/slots.py.
    lora_name: str | None = None


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """What changed for a request the workers already hold."""

    req_id: str
    # Output tokens the engine accepted since the workers last saw this request.
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int


class GrammarBitmask(msgspec.Struct, array_like=True, frozen=True):
    """The allowed next tokens of a step's structured rows: row i (int32 words, bit t % 32 of
    word t // 32 for token t) belongs to request `req_ids[i]`; other rows sample freely."""

    req_ids: list[str]
    bitmask: bytes  # [len(req_ids), num_words] int32, C order
    num_words: int


class KVBlockCopies(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Copies between the device KV cache and the host-memory tier that a step makes before its
    forward (shoal/kv_transfer/host_tier.py): first the offloads, device block
    `offload_block_ids[i]` → host block `offload_host_ids[i]` (cached blocks evicted to make
    room), then the loads, host block `load_host_ids[i]` → device block `load_block_ids[i]`
    (prefix hits on the host). In that order: a block evicted this step may be a load's target."""

    offload_block_ids: list[int] = msgspec.field(default_factory=list)
    offload_host_ids: list[int] = msgspec.field(default_factory=list)
    load_host_ids: list[int] = msgspec.field(default_factory=list)
    load_block_ids: list[int] = msgspec.field(default_factory=list)


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One step: which requests run, and how many of their tokens (`num_scheduled_tokens`,
    in batch order: new requests after cached ones, as `scheduled_req_ids` lists them)."""

    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the workers must forget: finished, aborted or preempted since the last step.
    finished_req_ids: list[str] = msgspec.field(default_factory=list)
    # The step's id, so that pipeline-parallel outputs can be matched to their step.
    step_id: int = 0
    # Requests whose grammar constrains the token they sample this step (structured output).
    structured_req_ids: list[str] = msgspec.field(default_factory=list)
    # Their bitmask, when the step carries it (filled as the scheduler built the step); with
    # `grammar_follows` it comes after the launch, through `sample_tokens` (async scheduling: the
    # step before is still running). The scheduler decides which, by the executor's
    # `samples_later`.
    grammar: GrammarBitmask | None = None
    grammar_follows: bool = False
    # Speculative decoding: per request, the draft tokens this step verifies after its last
    # known token; the request's `num_scheduled_tokens` count them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # The host-memory tier's copies this step makes before its forward (None: none).
    kv_block_copies: KVBlockCopies | None = None

    @property
    def scheduled_req_ids(self) -> list[str]:
        return list(self.num_scheduled_tokens)


class LogprobsLists(msgspec.Struct, array_like=True, frozen=True):
    """Logprobs of several positions, one row per position.

    Row i: `token_ids[i][0]` is the token actually at (or sampled for) that position and
    `logprobs[i][0]` its logprob; the rest are the top-N tokens in descending order.
    `ranks[i]` is the rank of the actual token among all tokens (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def slice(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end])


class RoutedExperts(msgspec.Struct, array_like=True, frozen=True):
    """The experts a mixture-of-experts model routed positions `start` .. `start + num_tokens`
    of one request to: `expert_ids` is int32 [num_tokens, num_layers, top_k] in C order, one
    row per decoder layer (-1 in layers without routed experts), each the router's top-k in its
    own order. Positions are the sequence's (prompt, then output tokens)."""

    start: int
    num_layers: int
    top_k: int
    expert_ids: bytes

    @property
    def num_tokens(self) -> int:
        return len(self.expert_ids) // (4 * self.num_layers * self.top_k)


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """The sampled tokens of one step, aligned with `req_ids` (an empty list for a request
    whose prompt is not finished yet)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request (aligned with req_ids) when it asked for logprobs.
    logprobs: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)
    # Per request, the rows of the prompt positions computed this step (position 0 excluded).
    prompt_logprobs: dict[str, LogprobsLists] = msgspec.field(default_factory=dict)
    step_id: int = 0
    # Speculative decoding: each request's drafts for its next step (aligned with req_ids;
    # empty when the engine does not speculate). `sampled_token_ids` then holds a request's
    # accepted drafts and one more token.
    spec_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    # Per request that asked for them (`return_routed_experts`) and sampled this step: the
    # experts of its positions computed since it last sampled.
    routed_experts: dict[str, RoutedExperts] = msgspec.field(default_factory=dict)
