"""`logprobs_mode` (vLLM's four names) against a hand computation on the logits: the value of
the sampled token, the top-N and the ranks, in one batch of a greedy row, a penalized row and a
temperature / top-k / top-p / min-p row; and the engine argument end to end, the raw logits of
a tiny Llama against transformers'."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal import LLM, SamplingParams
from shoal.config import EngineArgs
from shoal.workers.sampler import Sampler, build_sampling_metadata
from tests.workers.test_sampler import VOCAB, make_state, reference_probs

PROMPT, OUTPUT = (1, 2, 3), (4, 4, 9)
PARAMS = [
    SamplingParams(temperature=0.0, logprobs=2),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25, logprobs=2),
    SamplingParams(temperature=0.7, top_k=12, top_p=0.8, min_p=0.05, seed=3, logprobs=2),
]


def _penalized(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Repetition (prompt and output), frequency and presence (output) penalties, one token at a time."""
    row = row.clone()
    for t in set(PROMPT) | set(OUTPUT):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(OUTPUT):
        row[t] -= p.frequency_penalty * OUTPUT.count(t) + p.presence_penalty
    return row


def _expected(mode: str, row: torch.Tensor, p: SamplingParams) -> list[float]:
    if mode == "raw_logits":
        return row.tolist()
    if mode == "raw_logprobs":
        return row.log_softmax(-1).tolist()
    penalized = _penalized(row, p)
    if p.greedy:
        values = penalized
    else:
        probs = reference_probs(penalized, p)
        values = torch.where(probs > 0, penalized / p.temperature, -math.inf)
    return values.tolist() if mode == "processed_logits" else values.log_softmax(-1).tolist()


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"])
def test_sampled_and_top_values_follow_the_mode(mode: str) -> None:
    logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    states = [make_state(i, p, PROMPT, OUTPUT) for i, p in enumerate(PARAMS)]
    out = Sampler(mode)(logits.clone(), build_sampling_metadata(states, VOCAB, torch.device("cpu")))
    for i, p in enumerate(PARAMS):
        expected = _expected(mode, logits[i], p)
        sampled = int(out.sampled_token_ids[i])
        assert out.logprob_token_ids[i, 0] == sampled
        assert out.logprobs[i, 0].item() == pytest.approx(expected[sampled], abs=1e-5)
        top = sorted(range(VOCAB), key=lambda t: -expected[t])[:2]
        assert out.logprob_token_ids[i, 1:].tolist() == top
        assert out.logprobs[i, 1:].tolist() == pytest.approx([expected[t] for t in top], abs=1e-5)
        assert int(out.sampled_ranks[i]) == 1 + sum(v > expected[sampled] + 1e-6 for v in expected)


def test_bad_mode_is_refused(tiny_checkpoints) -> None:
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        EngineArgs(model=str(tiny_checkpoints["llama"]), logprobs_mode="logits").create_engine_config()


def test_raw_logits_of_the_engine_equal_transformers(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["llama"])
    llm = LLM(path, multiprocess=False, dtype="float32", logprobs_mode="raw_logits")
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, prompt_logprobs=0, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [5, 17, 42, 8]}, params, use_tqdm=False)[0]
    llm.shutdown()
    completion = out.outputs[0]
    sequence = out.prompt_token_ids + completion.token_ids
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        hf = model(torch.tensor([sequence])).logits[0]  # [len, vocab]: row p predicts token p + 1
    for j, position in enumerate(completion.logprobs):
        token = completion.token_ids[j]
        row = hf[len(out.prompt_token_ids) - 1 + j]
        assert position[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
    for p in range(1, len(out.prompt_token_ids)):
        token = out.prompt_token_ids[p]
        assert out.prompt_logprobs[p][token].logprob == pytest.approx(float(hf[p - 1, token]), abs=1e-4)
