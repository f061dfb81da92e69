"""The rejection sampler: its emitted tokens follow the target's distribution whatever the draft
(chi-square tests over many seeded samples, drafts skewed away from the target), greedy rows
follow argmax chains, seeds reproduce whatever else is batched, and the benchmark switch accepts
every draft."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.sampling_params import SamplingParams
from shoal.spec_decode.draft_layout import DraftLayout
from shoal.spec_decode.rejection_sampler import (
    RejectionSampler,
    RejectionSamplerOutput,
    verification_sampling_metadata,
)
from shoal.workers.input_batch import RequestState
from shoal.workers.sampler import Sampler, build_sampling_metadata, processed_logits, processed_probs
from tests.workers.test_sampler import reference_probs

CPU = torch.device("cpu")


def make_state(i: int, params: SamplingParams, output=(), prompt=(1, 2, 3), eos=None) -> RequestState:
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return RequestState(
        req_id=str(i),
        slot=i,
        num_prompt_tokens=len(prompt),
        sampling_params=params,
        eos_token_id=eos,
        generator=generator,
        output_token_ids=list(output),
        prompt_token_ids=list(prompt),
    )


def verify(
    states: list[RequestState],
    logits: torch.Tensor,
    drafts: list[list[int]],
    draft_probs: torch.Tensor | None = None,
    k: int = 3,
    accept_all: bool = False,
) -> RejectionSamplerOutput:
    layout = DraftLayout.of([len(d) for d in drafts])
    md = verification_sampling_metadata(states, drafts, logits.shape[-1], CPU)
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int32)  # as a device buffer may hold them
    return RejectionSampler(k, accept_all)(logits, layout, flat, draft_probs, md)


def emitted(output: RejectionSamplerOutput) -> list[list[int]]:
    counts = output.num_emitted.tolist()
    return [row[:n] for row, n in zip(output.token_ids.tolist(), counts)]


# ---- (a) the output distribution is the target's ----------------------------------------------

VOCAB = 8
TARGET_LOGITS = torch.tensor(
    [
        [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],  # position 0
        [-1.0, 0.0, 2.5, 0.3, 1.0, -2.0, 0.7, 0.1],  # position 1 (after draft 0)
        [0.0, 0.5, 1.0, 1.5, 2.0, 0.0, 0.0, 0.0],  # bonus position
    ]
)
PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
]


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """The p-value of observed `counts` under `probs` (categories of probability 0 must be empty)."""
    assert counts[probs == 0].sum() == 0, "a token the target gives probability 0 was emitted"
    support = probs > 0
    expected = counts.sum() * probs[support]
    statistic = float((((counts[support] - expected) ** 2) / expected).sum())
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


def skewed_draft_probs() -> torch.Tensor:
    """A draft distribution per position, most of its mass where the target has least."""
    return torch.softmax(-0.5 * TARGET_LOGITS[:2], dim=-1)


def sample_emissions(
    params: SamplingParams, draft_kind: str, num_requests: int, accept_all: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Many seeded requests of two drafts each at the positions of TARGET_LOGITS, in one batch.
    Returns (first emitted tokens, second emitted tokens, whether the first draft was accepted)."""
    rng = np.random.default_rng(0)
    q = skewed_draft_probs()
    if draft_kind == "point_mass":  # n-gram: the same fixed drafts, no probabilities
        drafts = [[1, 4]] * num_requests  # second-most likely tokens, not the argmax
        draft_probs = None
    else:  # a model's drafts, drawn from q
        firsts = rng.choice(VOCAB, size=num_requests, p=q[0].double().numpy() / q[0].double().sum().item())
        seconds = rng.choice(VOCAB, size=num_requests, p=q[1].double().numpy() / q[1].double().sum().item())
        drafts = [[int(a), int(b)] for a, b in zip(firsts, seconds)]
        draft_probs = q.repeat(num_requests, 1)  # [num_requests * 2, vocab], flattened draft order
    states = [
        make_state(i, SamplingParams(**{**_fields(params), "seed": 1000 + i}), output=()) for i in range(num_requests)
    ]
    logits = TARGET_LOGITS.repeat(num_requests, 1)
    output = verify(states, logits, drafts, draft_probs, k=2, accept_all=accept_all)
    tokens = output.token_ids.numpy()
    return tokens[:, 0], tokens[:, 1], output.num_accepted.numpy() >= 1


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in ("temperature", "top_k", "top_p", "min_p")}


@pytest.mark.parametrize("draft_kind", ["point_mass", "full_q"])
@pytest.mark.parametrize("params", PARAMS, ids=["temperature", "top_k", "top_p_min_p"])
def test_emitted_tokens_follow_the_target_distribution(params: SamplingParams, draft_kind: str) -> None:
    firsts, seconds, first_accepted = sample_emissions(params, draft_kind, num_requests=12_000)
    p0 = reference_probs(TARGET_LOGITS[0], params).double().numpy()
    p1 = reference_probs(TARGET_LOGITS[1], params).double().numpy()
    assert chi_square_p_value(np.bincount(firsts, minlength=VOCAB), p0) > 1e-3
    # Where the first draft was accepted, the second token is the target's at position 1 (its
    # logits there are conditioned on that draft, which these fixed rows stand for).
    assert first_accepted.sum() > 1000
    assert chi_square_p_value(np.bincount(seconds[first_accepted], minlength=VOCAB), p1) > 1e-3


def test_the_chi_square_test_sees_a_skewed_output() -> None:
    """The test above has power: accepting the skewed drafts unverified (the benchmark switch)
    gives an output the chi-square test rejects."""
    firsts, _, _ = sample_emissions(PARAMS[0], "full_q", num_requests=12_000, accept_all=True)
    p0 = reference_probs(TARGET_LOGITS[0], PARAMS[0]).double().numpy()
    assert chi_square_p_value(np.bincount(firsts, minlength=VOCAB), p0) < 1e-6


def test_verification_rows_sample_as_the_sampler_would_after_the_drafts() -> None:
    """Row j of a request has the distribution the normal sampler would give the request with its
    drafts 0..j-1 already emitted: penalties and min_tokens count them."""
    torch.manual_seed(0)
    params = [
        SamplingParams(temperature=0.9, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3),
        SamplingParams(temperature=0.8, min_tokens=4, top_k=6),
        SamplingParams(temperature=1.1, logit_bias={2: 3.0}, top_p=0.9),
    ]
    states = [make_state(i, p, output=(5, 6), eos=0) for i, p in enumerate(params)]
    drafts = [[5, 7, 5], [0, 9], []]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), 20) * 2
    md = verification_sampling_metadata(states, drafts, 20, CPU)
    probs = processed_probs(processed_logits(logits.clone(), md), md)
    row = 0
    for state, draft in zip(states, drafts):
        for j in range(len(draft) + 1):
            alone = make_state(0, state.sampling_params, output=[5, 6, *draft[:j]], eos=0)
            md_alone = build_sampling_metadata([alone], 20, CPU)
            expected = processed_probs(processed_logits(logits[row : row + 1].clone(), md_alone), md_alone)
            torch.testing.assert_close(probs[row : row + 1], expected)
            row += 1


# ---- (b) greedy rows follow argmax chains -----------------------------------------------------


def rows_with_argmax(argmaxes: list[int], vocab: int = 12) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_greedy_accepts_while_the_draft_is_the_argmax() -> None:
    greedy = SamplingParams(temperature=0.0)
    cases = [  # (drafts, the argmax of each row, emitted)
        ([5, 7, 1], [5, 7, 2, 9], [5, 7, 2]),  # the third draft refused: its row's argmax instead
        ([], [4], [4]),  # no drafts: the argmax, as without speculation
        ([3, 3], [3, 3, 8], [3, 3, 8]),  # all accepted: the bonus row's argmax
        ([1], [2, 6], [2]),  # the first refused
        ([4, 4, 4], [4, 4, 4, 11], [4, 4, 4, 11]),  # k drafts accepted: k + 1 tokens
    ]
    states = [make_state(i, greedy) for i in range(len(cases))]
    logits = torch.cat([rows_with_argmax(argmax) for _, argmax, _ in cases])
    output = verify(states, logits, [d for d, _, _ in cases])
    assert emitted(output) == [e for _, _, e in cases]
    assert output.token_ids.shape == (len(cases), 4)
    assert output.token_ids[1].tolist() == [4, -1, -1, -1]


def test_greedy_rows_keep_their_chains_beside_sampled_rows() -> None:
    states = [make_state(0, SamplingParams(temperature=0.0)), make_state(1, SamplingParams(temperature=1.0, seed=3))]
    drafts = [[5, 7, 1], [2, 2]]
    logits = torch.cat([rows_with_argmax([5, 7, 2, 9]), torch.randn(3, 12)])
    assert emitted(verify(states, logits, drafts))[0] == [5, 7, 2]


def test_greedy_with_penalties_counts_the_accepted_drafts() -> None:
    """Token 10 leads every row, but once drafted its repetition penalty puts 11 first: the second
    draft (10 again) is refused and 11 emitted, as greedy decoding without drafts would."""
    state = make_state(0, SamplingParams(temperature=0.0, repetition_penalty=2.0))
    logits = torch.zeros(3, 12)
    logits[:, 10], logits[:, 11] = 2.0, 1.5
    assert emitted(verify([state], logits, [[10, 10]])) == [[10, 11]]
    assert greedy_without_drafts(state, logits)[:2] == [10, 11]


def test_min_tokens_ends_inside_an_accepted_run() -> None:
    """eos (0) leads every row; min_tokens=2 bans it in the first two rows only."""
    state = make_state(0, SamplingParams(temperature=0.0, min_tokens=2), eos=0)
    logits = torch.zeros(3, 12)
    logits[:, 0], logits[0, 5], logits[1, 6] = 3.0, 2.0, 2.0
    assert emitted(verify([state], logits, [[5, 6]])) == [[5, 6, 0]]
    assert greedy_without_drafts(state, logits) == [5, 6, 0]


def greedy_without_drafts(state: RequestState, logits: torch.Tensor) -> list[int]:
    """The normal sampler, one row a step, each step's token appended to the output."""
    tokens: list[int] = []
    for row in range(logits.shape[0]):
        current = make_state(0, state.sampling_params, output=tokens, eos=state.eos_token_id)
        md = build_sampling_metadata([current], logits.shape[-1], CPU)
        tokens.append(int(Sampler()(logits[row : row + 1].clone(), md).sampled_token_ids[0]))
    return tokens


# ---- (c) seeds --------------------------------------------------------------------------------


def seeded_batch(order: list[int], other_drafts: list[int]) -> list[list[int]]:
    """Request 0 (seed 7, three drafts) among unseeded requests with other draft counts; returns
    what each request emitted, in the given order of the requests."""
    torch.manual_seed(len(order))  # the unseeded requests' draws differ from batch to batch
    vocab = 1000
    rows = torch.Generator().manual_seed(1)
    logits_of = {i: torch.randn(4, vocab, generator=rows) * 0.5 for i in range(len(other_drafts) + 1)}
    drafts_of = {0: [1, 2, 3], **{i + 1: list(range(n)) for i, n in enumerate(other_drafts)}}
    states = [make_state(i, SamplingParams(temperature=1.0, seed=7 if i == 0 else None, top_p=0.95)) for i in order]
    logits = torch.cat([logits_of[i][: len(drafts_of[i]) + 1] for i in order])
    # Draft 1 of request 0 is its row's most likely token, so the run goes past it sometimes.
    for row, i in zip(np.cumsum([0] + [len(drafts_of[i]) + 1 for i in order])[:-1], order):
        logits[row : row + len(drafts_of[i]), drafts_of[i]] += 4.0
    return emitted(verify(states, logits, [drafts_of[i] for i in order]))


def test_a_seed_gives_the_same_tokens_whatever_else_is_batched() -> None:
    alone = seeded_batch([0], [])
    assert seeded_batch([0], []) == alone  # the same seed twice
    assert seeded_batch([1, 0, 2], [2, 0])[1] == alone[0]
    assert seeded_batch([2, 3, 1, 0], [3, 1, 2])[3] == alone[0]


def test_unseeded_requests_differ_between_draws() -> None:
    """The check above is not vacuous: the same request unseeded emits other tokens."""
    state = make_state(0, SamplingParams(temperature=1.0))
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)) * 0.5
    outputs = {tuple(emitted(verify([state], logits, [[1, 2, 3]]))[0]) for _ in range(5)}
    assert len(outputs) > 1


# ---- (d) the benchmark switch -----------------------------------------------------------------


def test_accept_all_emits_every_draft_and_a_bonus_token() -> None:
    states = [make_state(0, SamplingParams(temperature=0.0)), make_state(1, SamplingParams(temperature=0.8, seed=1))]
    drafts = [[5, 7, 1], [2]]  # the greedy request's last draft is not its row's argmax
    logits = torch.cat([rows_with_argmax([5, 7, 2, 9]), rows_with_argmax([0, 3])])
    logits[4:] *= 10  # the sampled request's bonus row is near one-hot at 3
    output = verify(states, logits, drafts, accept_all=True)
    assert emitted(output) == [[5, 7, 1, 9], [2, 3]]
    assert output.num_accepted.tolist() == [3, 1]


# ---- logprobs, shapes -------------------------------------------------------------------------


def test_logprobs_of_the_emitted_tokens_come_from_the_raw_logits() -> None:
    states = [
        make_state(0, SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=3.0)),
        make_state(1, SamplingParams(temperature=0.0)),
    ]
    drafts = [[5, 7, 1], [4]]
    logits = torch.cat([rows_with_argmax([5, 7, 2, 9]), rows_with_argmax([4, 8])]) + torch.randn(6, 12) * 0.1
    output = verify(states, logits, drafts)
    assert emitted(output) == [[5, 7, 2], [4, 8]]
    raw = logits.log_softmax(dim=-1)
    assert output.logprob_token_ids is not None and output.logprobs is not None and output.sampled_ranks is not None
    for row, token in [(0, 5), (1, 7), (2, 2), (4, 4), (5, 8)]:  # request 0's rows 0-2, request 1's rows 0-1
        assert output.logprob_token_ids[row, 0] == token
        torch.testing.assert_close(output.logprobs[row, 0], raw[row, token])
        top_lp, top_ids = raw[row].topk(2)
        assert output.logprob_token_ids[row, 1:].tolist() == top_ids.tolist()
        torch.testing.assert_close(output.logprobs[row, 1:], top_lp)
        assert output.sampled_ranks[row] == 1


def test_a_wrongly_shaped_step_is_refused() -> None:
    states = [make_state(0, SamplingParams(temperature=0.0))]
    with pytest.raises(ValueError, match="more than num_speculative_tokens=2"):
        verify(states, torch.zeros(4, 12), [[1, 2, 3]], k=2)
    layout = DraftLayout.of([2])
    md = verification_sampling_metadata(states, [[1, 2]], 12, CPU)
    with pytest.raises(ValueError, match="need 3 logits rows"):
        RejectionSampler(3)(torch.zeros(2, 12), layout, torch.tensor([1, 2]), None, md)
