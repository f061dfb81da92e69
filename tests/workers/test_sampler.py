"""The sampler against explicit per-row references computed on the logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shoal.sampling_params import SamplingParams
from shoal.step import GrammarBitmask
from shoal.workers import sampler as sampler_module
from shoal.workers.grammar_bitmask import GrammarBitmaskLoader
from shoal.workers.input_batch import RequestState
from shoal.workers.sampler import Sampler, apply_penalties, build_sampling_metadata, processed_probs

VOCAB = 50


def make_state(i: int, params: SamplingParams, prompt=(1, 2, 3), output=(), eos=0) -> RequestState:
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
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


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row: temperature, top-k, top-p, min-p, written out the obvious way."""
    x = (logits / p.temperature).tolist()
    keep = set(range(len(x)))
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if p.top_k > 0:
        keep &= set(order[: p.top_k])
    if p.top_p < 1.0:
        z = sum(math.exp(x[i]) for i in keep)
        mass, kept = 0.0, set()
        for i in order:
            if i not in keep:
                continue
            kept.add(i)
            mass += math.exp(x[i]) / z
            if mass >= p.top_p:
                break
        keep = kept
    z = sum(math.exp(x[i]) for i in keep)
    probs = [math.exp(x[i]) / z if i in keep else 0.0 for i in range(len(x))]
    if p.min_p > 0:
        threshold = p.min_p * max(probs)
        probs = [q if q >= threshold else 0.0 for q in probs]
        z = sum(probs)
        probs = [q / z for q in probs]
    return torch.tensor(probs)


PARAMS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=0.5, top_k=10, top_p=0.8, min_p=0.05),
]


def test_processed_probs_match_reference() -> None:
    torch.manual_seed(0)
    logits = torch.randn(len(PARAMS), VOCAB) * 3
    states = [make_state(i, p) for i, p in enumerate(PARAMS)]
    md = build_sampling_metadata(states, VOCAB, torch.device("cpu"))
    probs = processed_probs(logits, md)
    for row, p in enumerate(PARAMS):
        torch.testing.assert_close(probs[row], reference_probs(logits[row], p).float(), atol=1e-6, rtol=1e-5)


def test_samples_only_allowed_tokens_with_right_frequencies() -> None:
    torch.manual_seed(1)
    row = torch.randn(VOCAB) * 2
    p = SamplingParams(temperature=1.0, top_k=4)
    reference = reference_probs(row, p)
    states = [make_state(i, p) for i in range(4000)]
    md = build_sampling_metadata(states, VOCAB, torch.device("cpu"))
    sampled = Sampler()(row.repeat(len(states), 1), md).sampled_token_ids
    counts = torch.bincount(sampled, minlength=VOCAB).float() / len(states)
    assert set(sampled.tolist()) <= set(torch.nonzero(reference).flatten().tolist())
    assert (counts - reference).abs().max() < 0.03


def test_plain_batches_get_the_general_metadata() -> None:
    """Batches of temperature-only requests take a shortcut; it must build what the general
    path builds for them (and any other request sends the batch down the general path)."""
    plain = [SamplingParams(temperature=0.6), SamplingParams(temperature=0.0), SamplingParams(temperature=1.2)]
    states = [make_state(i, p) for i, p in enumerate(plain)]
    assert all(s.plain for s in states)
    fast = build_sampling_metadata(states, VOCAB, torch.device("cpu"))
    general = sampler_module._general_sampling_metadata(states, VOCAB, torch.device("cpu"))
    for name, value in vars(general).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(getattr(fast, name), value), name
        else:
            assert getattr(fast, name) == value, name
    others = [*PARAMS[1:], SamplingParams(min_tokens=2), SamplingParams(logprobs=1), SamplingParams(seed=3)]
    others += [SamplingParams(repetition_penalty=1.2), SamplingParams(presence_penalty=0.5)]
    for other in others:
        assert not make_state(9, other).plain, other


def reference_penalties(logits: torch.Tensor, state: RequestState) -> torch.Tensor:
    p = state.sampling_params
    out = logits.clone()
    for token in set(state.prompt_token_ids) | set(state.output_token_ids):
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token in set(state.output_token_ids):
        out[token] -= p.frequency_penalty * state.output_token_ids.count(token) + p.presence_penalty
    return out


def test_penalties_match_reference() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB)
    states = [
        make_state(0, SamplingParams(repetition_penalty=1.5), prompt=(4, 5, 6), output=(5, 7, 7)),
        make_state(1, SamplingParams(frequency_penalty=0.5, presence_penalty=0.3), output=(9, 9, 9, 2)),
        make_state(2, SamplingParams(), output=(1,)),
    ]
    md = build_sampling_metadata(states, VOCAB, torch.device("cpu"))
    penalized = apply_penalties(logits, md)
    for row, state in enumerate(states):
        torch.testing.assert_close(penalized[row], reference_penalties(logits[row], state))


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, VOCAB)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draw(batch_rows: list[int], steps: int = 5) -> list[int]:
        states = [make_state(i, seeded if i == 0 else SamplingParams(temperature=1.0)) for i in batch_rows]
        tokens = []
        for _ in range(steps):
            md = build_sampling_metadata(states, VOCAB, torch.device("cpu"))
            tokens.append(int(Sampler()(logits[batch_rows], md).sampled_token_ids[0]))
        return tokens

    alone = draw([0])
    assert draw([0, 1, 2, 3]) == alone
    assert draw([0, 5]) == alone
    assert len(set(alone)) > 1  # really sampling, not argmax


def test_greedy_rows_take_argmax_and_min_tokens_masks_eos() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 10.0  # eos (id 0) is the most likely token
    logits[:, 7] = 5.0
    states = [
        make_state(0, SamplingParams(temperature=0.0)),
        make_state(1, SamplingParams(temperature=0.0, min_tokens=2), output=(3,)),
    ]
    md = build_sampling_metadata(states, VOCAB, torch.device("cpu"))
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [0, 7]


@pytest.mark.parametrize("num_logprobs", [0, 3])
def test_logprobs_come_from_raw_logits(num_logprobs: int) -> None:
    torch.manual_seed(4)
    logits = torch.randn(2, VOCAB)
    params = SamplingParams(temperature=0.0, logprobs=num_logprobs, repetition_penalty=2.0)
    states = [make_state(i, params, output=(int(logits[i].argmax()),)) for i in range(2)]
    out = Sampler()(logits, build_sampling_metadata(states, VOCAB, torch.device("cpu")))
    raw = logits.log_softmax(-1)
    for row in range(2):
        sampled = int(out.sampled_token_ids[row])
        assert out.logprob_token_ids[row, 0] == sampled
        assert out.logprobs[row, 0] == pytest.approx(float(raw[row, sampled]), abs=1e-6)
        assert int(out.sampled_ranks[row]) == int((raw[row] > raw[row, sampled]).sum()) + 1
        top = raw[row].topk(num_logprobs)
        assert out.logprob_token_ids[row, 1:].tolist() == top.indices.tolist()


def test_top_logprobs_order_equal_values_by_token_id_whatever_the_batch() -> None:
    """bfloat16 logits tie often; a row's top-n list (ids and order) is its own, in any batch."""
    gen = torch.Generator().manual_seed(5)
    row = torch.randn(VOCAB, generator=gen).to(torch.bfloat16).float()
    row[[3, 17, 40]] = row.max() + 1  # a three-way tie at the top
    row[[8, 9]] = -float("inf")  # masked tokens
    logprobs = row.log_softmax(-1)
    values, ids = sampler_module.top_logprobs(logprobs[None], 5)
    assert ids[0, :3].tolist() == [3, 17, 40]
    expected = sorted(range(VOCAB), key=lambda t: (-float(logprobs[t]), t))[:5]
    assert ids[0].tolist() == expected and torch.equal(values[0], logprobs[expected])
    for batch_size in (2, 7, 64):
        batch = torch.randn(batch_size, VOCAB, generator=gen).log_softmax(-1)
        batch[batch_size // 2] = logprobs
        in_batch_values, in_batch_ids = sampler_module.top_logprobs(batch, 5)
        assert in_batch_ids[batch_size // 2].tolist() == expected
        assert torch.equal(in_batch_values[batch_size // 2], values[0])
    assert sampler_module.top_logprobs(logprobs[None], 0)[1].shape == (1, 0)


# ---- logit_bias and grammar bitmasks ------------------------------------------------------------


def _pack(allowed: torch.Tensor) -> np.ndarray:
    """[rows, vocab] bool -> int32 bit words (bit t % 32 of word t // 32 for token t)."""
    rows, vocab = allowed.shape
    words = np.zeros((rows, -(-vocab // 32)), dtype=np.uint32)
    for row, token in allowed.nonzero().tolist():
        words[row, token // 32] |= np.uint32(1 << (token % 32))
    return words.view(np.int32)


def test_logit_bias_is_added_to_its_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    states = [
        make_state(0, SamplingParams(temperature=0.0, logit_bias={7: 100.0})),
        make_state(1, SamplingParams(temperature=0.0)),
        make_state(2, SamplingParams(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0, 3: 0.5})),
    ]
    md = build_sampling_metadata(states, VOCAB, torch.device("cpu"))
    expected = logits.clone()
    expected[0, 7] += 100.0
    expected[2, int(logits[2].argmax())] -= 100.0
    expected[2, 3] += 0.5
    assert Sampler()(logits, md).sampled_token_ids.tolist() == expected.argmax(-1).tolist()


def test_allowed_token_ids_restrict_their_rows_only() -> None:
    """Sampled and greedy rows with allowed_token_ids draw only from them (a greedy row takes
    the best of them); other rows in the batch are untouched; logprobs stay the raw ones."""
    torch.manual_seed(5)
    allowed = [3, 11, 40]
    states = [
        make_state(0, SamplingParams(temperature=1.0, allowed_token_ids=allowed, logprobs=1)),
        make_state(1, SamplingParams(temperature=0.0)),
        make_state(2, SamplingParams(temperature=0.0, allowed_token_ids=allowed)),
    ]
    assert not states[0].plain and not states[2].plain and states[1].plain
    seen = set()
    for _ in range(30):
        logits = torch.randn(3, VOCAB)
        out = Sampler()(logits, build_sampling_metadata(states, VOCAB, torch.device("cpu")))
        sampled = out.sampled_token_ids.tolist()
        seen.add(sampled[0])
        assert sampled[0] in allowed
        assert sampled[1] == int(logits[1].argmax())
        assert sampled[2] == max(allowed, key=lambda t: float(logits[2, t]))
        assert out.logprobs is not None
        assert out.logprobs[0, 0] == pytest.approx(float(logits[0].log_softmax(-1)[sampled[0]]))
    assert len(seen) > 1  # sampled, not forced to one token


@pytest.mark.parametrize("every_row", [True, False])
def test_token_bitmask_masks_exactly_the_disallowed_tokens(every_row: bool) -> None:
    torch.manual_seed(2)
    num_rows, vocab = 4, 70  # not a multiple of 32: the last word is partial
    logits = torch.randn(num_rows, vocab)
    masked_rows = list(range(num_rows)) if every_row else [1, 3]
    allowed = torch.rand(len(masked_rows), vocab) < 0.3
    bitmask = torch.from_numpy(_pack(allowed))
    rows = None if every_row else torch.tensor(masked_rows)
    out = sampler_module.apply_token_bitmask(logits, bitmask, rows)
    expected = logits.clone()
    for i, row in enumerate(masked_rows):
        expected[row, ~allowed[i]] = -math.inf
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(top_k=5, logprobs=2)]
)
def test_sampled_tokens_obey_the_bitmask(params: SamplingParams) -> None:
    """Plain and general batches alike: every structured row samples an allowed token, the
    other rows are untouched, and logprobs are those of the masked logits."""
    torch.manual_seed(3)
    states = [make_state(i, params) for i in range(6)]
    allowed = torch.zeros(3, VOCAB, dtype=torch.bool)
    for i in range(3):
        allowed[i, torch.randperm(VOCAB)[:4]] = True
    grammar = GrammarBitmask(req_ids=["0", "2", "5"], bitmask=_pack(allowed).tobytes(), num_words=-(-VOCAB // 32))
    for _ in range(20):
        logits = torch.randn(6, VOCAB)
        md = build_sampling_metadata(states, VOCAB, torch.device("cpu"))
        loaded = GrammarBitmaskLoader(8, torch.device("cpu")).load(grammar, [s.req_id for s in states])
        md = sampler_module.with_token_bitmask(md, *loaded)
        out = Sampler()(logits, md)
        sampled = out.sampled_token_ids.tolist()
        assert all(allowed[i, sampled[row]] for i, row in enumerate([0, 2, 5]))
        if params.greedy:
            assert sampled[1] == int(logits[1].argmax()) and sampled[3] == int(logits[3].argmax())
        if out.logprobs is not None:
            assert out.logprobs[0, 0] == pytest.approx(
                float(logits[0].masked_fill(~allowed[0], -math.inf).log_softmax(-1)[sampled[0]])
            )
