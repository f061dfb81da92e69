"""`Sampler`: from one row of logits per request to the next token, on the device.

Order of operations: a structured row's grammar bitmask (disallowed tokens to -inf; logprobs
are taken after it, as vLLM's are); then, as transformers' `generate` applies them,
repetition, frequency and presence penalties; logit_bias; allowed_token_ids (every other
token masked); min_tokens (eos and stop tokens masked); then for sampled rows temperature,
top-k, top-p and min-p; greedy rows take the argmax of the penalized logits. Sampling uses the
exponential race (argmax of p / q, q ~ Exp(1)), equivalent to drawing from p; a request with a
seed draws its q from its own generator, so its tokens do not depend on what else is batched.

Logprobs come from the raw logits, before any of the above but the grammar (vLLM V1's
convention), unless the engine's `logprobs_mode` asks for logits or for the processed values
(shoal/workers/logprobs_mode.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shoal.kernels.gumbel_sample import fused_sampling_kernel
from shoal.step import LogprobsLists
from shoal.workers.input_batch import RequestState
from shoal.workers.logprobs_mode import is_raw, processed_values, raw_values


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one step, as device tensors (None where unused)."""

    temperature: torch.Tensor  # [num_rows] float32, 1.0 on greedy rows
    greedy: torch.Tensor  # [num_rows] bool
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None  # [num_rows] int64, 0 = off
    top_p: torch.Tensor | None  # [num_rows] float32
    min_p: torch.Tensor | None  # [num_rows] float32
    generators: dict[int, torch.Generator]
    max_num_logprobs: int  # -1: no row wants logprobs
    # Penalties: token histories padded with vocab_size (a bin that is dropped).
    repetition_penalty: torch.Tensor | None  # [num_rows]
    frequency_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None  # [num_rows, max_prompt_len]
    output_token_ids: torch.Tensor | None  # [num_rows, max_output_len]
    # Rows still under min_tokens and the tokens they may not sample yet.
    min_tokens_mask: list[tuple[int, list[int]]]
    # logit_bias: (rows, token ids, biases), one entry per biased token of a row.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # allowed_token_ids: (the rows that have them, then rows and token ids: one entry per
    # allowed token of a row).
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Structured output: the allowed tokens of some rows, int32 bit words [num_masked, num_words],
    # and which rows they are (None: every row, in order).
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None


def build_sampling_metadata(states: list[RequestState], vocab_size: int, device: torch.device) -> SamplingMetadata:
    if all(s.plain for s in states):  # most batches: the general build with nothing but temperatures
        greedy = [s.greedy for s in states]
        temperature = _column([s.temperature for s in states], torch.float32, device)
        return temperatures_only(temperature, _column(greedy, torch.bool, device), all(greedy), any(greedy))
    return _general_sampling_metadata(states, vocab_size, device)


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def temperatures_only(
    temperature: torch.Tensor, greedy: torch.Tensor, all_greedy: bool, any_greedy: bool
) -> SamplingMetadata:
    """The metadata of a batch of plain requests (`RequestState.plain`): each row's temperature
    (1.0 where greedy) and whether it is greedy; what `_general_sampling_metadata` builds for
    them."""
    return SamplingMetadata(
        temperature=temperature,
        greedy=greedy,
        all_greedy=all_greedy,
        any_greedy=any_greedy,
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
        max_num_logprobs=-1,
        repetition_penalty=None,
        frequency_penalty=None,
        presence_penalty=None,
        prompt_token_ids=None,
        output_token_ids=None,
        min_tokens_mask=[],
    )


def _general_sampling_metadata(states: list[RequestState], vocab_size: int, device: torch.device) -> SamplingMetadata:
    params = [s.sampling_params for s in states]
    greedy = [s.greedy for s in states]

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return _column(values, dtype, device)

    use_penalties = any(p.uses_penalties for p in params)
    return SamplingMetadata(
        temperature=column([s.temperature for s in states], torch.float32),
        greedy=column(greedy, torch.bool),
        all_greedy=all(greedy),
        any_greedy=any(greedy),
        top_k=column([p.top_k for p in params], torch.int64) if any(p.top_k > 0 for p in params) else None,
        top_p=column([p.top_p for p in params], torch.float32) if any(p.top_p < 1.0 for p in params) else None,
        min_p=column([p.min_p for p in params], torch.float32) if any(p.min_p > 0 for p in params) else None,
        generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
        max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        repetition_penalty=column([p.repetition_penalty for p in params], torch.float32) if use_penalties else None,
        frequency_penalty=column([p.frequency_penalty for p in params], torch.float32) if use_penalties else None,
        presence_penalty=column([p.presence_penalty for p in params], torch.float32) if use_penalties else None,
        prompt_token_ids=_pad([s.prompt_token_ids for s in states], vocab_size, device) if use_penalties else None,
        output_token_ids=_pad([s.output_token_ids for s in states], vocab_size, device) if use_penalties else None,
        min_tokens_mask=[(i, _min_tokens_banned(s)) for i, s in enumerate(states) if _under_min_tokens(s)],
        logit_bias=_logit_bias(params, device) if any(p.logit_bias for p in params) else None,
        allowed_token_ids=_allowed_token_ids(params, device) if any(p.allowed_token_ids for p in params) else None,
    )


def _logit_bias(params: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, token_ids, biases = [], [], []
    for row, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(row)
            token_ids.append(token_id)
            biases.append(bias)
    return (
        _column(rows, torch.int64, device),
        _column(token_ids, torch.int64, device),
        _column(biases, torch.float32, device),
    )


def _allowed_token_ids(params: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, id_rows, token_ids = [], [], []
    for row, p in enumerate(params):
        if p.allowed_token_ids:
            rows.append(row)
            id_rows.extend([row] * len(p.allowed_token_ids))
            token_ids.extend(p.allowed_token_ids)
    return (
        _column(rows, torch.int64, device),
        _column(id_rows, torch.int64, device),
        _column(token_ids, torch.int64, device),
    )


def apply_allowed_token_ids(
    logits: torch.Tensor, allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """`logits` with every token but a row's allowed ones set to -inf, on the rows that have
    allowed tokens."""
    rows, id_rows, token_ids = allowed
    banned = torch.zeros_like(logits, dtype=torch.bool)  # [num_rows, vocab_size]
    banned[rows] = True
    banned[id_rows, token_ids] = False
    return logits.masked_fill(banned, -float("inf"))


def with_token_bitmask(
    metadata: SamplingMetadata, bitmask: torch.Tensor, rows: torch.Tensor | None
) -> SamplingMetadata:
    """The metadata with a grammar's bitmask ([num_masked, num_words] int32 on the device) for
    the sampling rows `rows` (None: every row, in order)."""
    return dataclasses.replace(metadata, token_bitmask=bitmask, bitmask_rows=rows)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """`logits` with the tokens a row's bitmask disallows set to -inf (bit t % 32 of word t // 32
    is token t; tokens past the bitmask's words are disallowed)."""
    num_rows, vocab_size = bitmask.shape[0], logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(num_rows, -1)  # [num_rows, 32 * num_words]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab_size]
    if rows is None:
        return logits.masked_fill(~allowed, -float("inf"))
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, -float("inf")))


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    padded = [r + [pad] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64).reshape(len(rows), width).to(device, non_blocking=True)


def _under_min_tokens(state: RequestState) -> bool:
    return len(state.output_token_ids) < state.sampling_params.min_tokens


def _min_tokens_banned(state: RequestState) -> list[int]:
    banned = list(state.sampling_params.stop_token_ids)
    if state.eos_token_id is not None and not state.sampling_params.ignore_eos:
        banned.append(state.eos_token_id)
    return banned


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    # Row i: [sampled, top-1, ..., top-N] token ids and logprobs; ranks of the sampled tokens.
    logprob_token_ids: torch.Tensor | None = None  # [num_rows, 1 + N]
    logprobs: torch.Tensor | None = None  # [num_rows, 1 + N]
    sampled_ranks: torch.Tensor | None = None  # [num_rows]


class Sampler(torch.nn.Module):
    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        super().__init__()
        self.logprobs_mode = logprobs_mode

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.token_bitmask is not None:
            logits = apply_token_bitmask(logits, metadata.token_bitmask, metadata.bitmask_rows)
        sampled = self._sample_in_one_pass(logits, metadata)
        if sampled is not None:
            return SamplerOutput(sampled_token_ids=sampled)
        logits = logits.float()  # [num_rows, vocab_size]
        wants_logprobs = metadata.max_num_logprobs >= 0
        raw = raw_values(self.logprobs_mode, logits) if wants_logprobs and is_raw(self.logprobs_mode) else None
        logits = processed_logits(logits, metadata)
        probs = None
        if metadata.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            probs = processed_probs(logits, metadata)
            sampled = sample_from_probs(probs, metadata.generators)
            if metadata.any_greedy:  # the argmax only where some row needs it (a pass over the vocab)
                sampled = torch.where(metadata.greedy, logits.argmax(dim=-1), sampled)
        output = SamplerOutput(sampled_token_ids=sampled)
        if wants_logprobs:
            values = raw if raw is not None else self._processed_values(logits, probs, metadata)
            gather_logprobs(output, values, sampled, metadata.max_num_logprobs)
        return output

    def _processed_values(self, logits: torch.Tensor, probs: torch.Tensor | None, md: SamplingMetadata) -> torch.Tensor:
        """The processed mode's values: the tokens top-k, top-p and min-p cut are those left
        with no probability."""
        cuts = md.top_k is not None or md.top_p is not None or md.min_p is not None
        if cuts and probs is None:
            probs = processed_probs(logits, md)
        return processed_values(self.logprobs_mode, logits, md.temperature, probs == 0 if cuts else None)

    @staticmethod
    def _sample_in_one_pass(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor | None:
        """Plain temperature batches (no logprobs, penalties, min_tokens, logit_bias,
        allowed_token_ids, top-k/p, min-p or per-request seeds) take the one-pass Gumbel-max kernel straight from the model's logits,
        without the float32 copy; None where the general path is needed."""
        plain = md.max_num_logprobs < 0 and md.repetition_penalty is None and not md.min_tokens_mask
        plain = plain and md.logit_bias is None and md.allowed_token_ids is None
        plain = plain and md.top_k is None and md.top_p is None and md.min_p is None and not md.generators
        if not plain or md.all_greedy:
            return None
        op = fused_sampling_kernel(logits)
        if op is None:
            return None
        sampled = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        op(sampled, logits, md.temperature, int(torch.randint(2**31 - 1, ())))  # the step's seed
        if md.any_greedy:  # bf16 -> float32 is exact, so this argmax is the general path's
            sampled = torch.where(md.greedy, logits.argmax(dim=-1), sampled)
        return sampled


def processed_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Float32 logits after penalties, logit_bias, allowed_token_ids and min_tokens: what greedy rows take the
    argmax of and `processed_probs` starts from (min_tokens writes in place)."""
    logits = apply_penalties(logits, md)
    if md.logit_bias is not None:
        rows, token_ids, biases = md.logit_bias
        logits = logits.index_put((rows, token_ids), biases, accumulate=True)
    if md.allowed_token_ids is not None:
        logits = apply_allowed_token_ids(logits, md.allowed_token_ids)
    for row, banned in md.min_tokens_mask:
        logits[row, banned] = -float("inf")
    return logits


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty (over prompt and output tokens, as in CTRL and transformers), then
    frequency and presence penalties (over output tokens, as in OpenAI's API)."""
    if md.repetition_penalty is None:
        return logits
    assert md.prompt_token_ids is not None and md.output_token_ids is not None
    assert md.frequency_penalty is not None and md.presence_penalty is not None
    num_rows, vocab_size = logits.shape
    output_counts = _bin_counts(md.output_token_ids, num_rows, vocab_size)  # [num_rows, vocab]
    seen = (_bin_counts(md.prompt_token_ids, num_rows, vocab_size) + output_counts) > 0
    penalty = torch.where(seen, md.repetition_penalty[:, None], 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - md.frequency_penalty[:, None] * output_counts
    return logits - md.presence_penalty[:, None] * (output_counts > 0)


def _bin_counts(token_ids: torch.Tensor, num_rows: int, vocab_size: int) -> torch.Tensor:
    """How often each token occurs per row; the padding id `vocab_size` lands in a dropped bin."""
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def processed_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution sampled rows draw from: temperature, then top-k, top-p, min-p."""
    logits = logits / md.temperature[:, None]
    if md.top_k is not None or md.top_p is not None:
        logits = _top_k_top_p(logits, md.top_k, md.top_p)
    probs = logits.softmax(dim=-1)
    if md.min_p is not None:
        threshold = md.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, 0.0, probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask all but each row's k most likely tokens, then all but the smallest set whose
    probability reaches top_p (the most likely token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [num_rows, vocab]
    vocab_size = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size)
        ranks = torch.arange(vocab_size, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], -float("inf"))
    if top_p is not None:
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], -float("inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_from_probs(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row drawn from `probs` by the exponential race (no host sync)."""
    q = torch.empty_like(probs).exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div(q).argmax(dim=-1)


def gather_logprobs(output: SamplerOutput, raw_logprobs: torch.Tensor, sampled: torch.Tensor, n: int) -> None:
    """Fill `output`'s logprob fields: each row's `sampled` token, its top `n`, its rank."""
    sampled_lp = raw_logprobs.gather(-1, sampled[:, None])  # [num_rows, 1]
    output.sampled_ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
    top_lp, top_ids = top_logprobs(raw_logprobs, n)
    output.logprob_token_ids = torch.cat([sampled[:, None], top_ids], dim=-1)
    output.logprobs = torch.cat([sampled_lp, top_lp], dim=-1)


# Rows a pass of `top_logprobs`: its int64 keys take 8 bytes a vocabulary entry (32 rows of a
# 152k vocabulary: 39 MB), memory the start-up profile does not see.
_TOP_LOGPROBS_ROWS = 32


def top_logprobs(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's n largest logprobs [num_rows, n] and their token ids, equal values in token-id
    order. torch.topk leaves the order of equal values to its kernel, which the number of rows
    may choose (on CUDA), and bfloat16 logits tie often: a request's top-n list would then change
    with the batch around it. Each value is made unique by packing it with its token id into one
    int64 key (`_tie_broken_keys`), in passes of a few rows."""
    if n == 0:
        return logprobs[:, :0], torch.zeros_like(logprobs[:, :0], dtype=torch.int64)
    low = 1 << 32
    inverted_ids = (low - 1) - torch.arange(logprobs.shape[-1], device=logprobs.device)  # a lower id ranks higher
    top_ids = torch.cat(
        [
            (low - 1) - _tie_broken_keys(rows, inverted_ids).topk(n, dim=-1).values.remainder(low)
            for rows in logprobs.split(_TOP_LOGPROBS_ROWS)
        ]
    )
    return logprobs.gather(-1, top_ids), top_ids


def _tie_broken_keys(rows: torch.Tensor, inverted_ids: torch.Tensor) -> torch.Tensor:
    """ordered(value) * 2^32 + inverted id, int64: the float's bits as an int32 of the same order
    (a negative float's magnitude bits flipped, since its bit pattern grows as it falls)."""
    bits = rows.float().view(torch.int32)
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    return keys.mul_(1 << 32).add_(inverted_ids)


def logprobs_lists(
    token_ids: torch.Tensor, logprobs: torch.Tensor, ranks: torch.Tensor, num_logprobs: list[int]
) -> list[LogprobsLists]:
    """Split per-row logprob tensors into one `LogprobsLists` (of one row) per request, each
    cut to the number of logprobs it asked for."""
    ids, lps, rks = token_ids.tolist(), logprobs.tolist(), ranks.tolist()
    return [LogprobsLists([ids[i][: n + 1]], [lps[i][: n + 1]], [rks[i]]) for i, n in enumerate(num_logprobs)]
