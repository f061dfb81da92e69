"""`LLM.beam_search` against Hugging Face transformers' beam search, beam by beam and score by
score, on a tiny random checkpoint; with a beam width of 1 it is greedy decoding.

The settings that make the two the same algorithm: transformers with `early_stopping="never"`
(it then stops only when no live beam can still beat the finished ones, which is shoal's exact
bound; its default heuristics stop earlier), and both count a beam's length as its generated
tokens, eos included. To have beams end on an eos within a few tokens on random weights, the
checkpoint's copy lists a token the model likes as a second eos (generation_config.json, which
both read)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shoal import LLM, BeamSearchParams, SamplingParams
from tests.hf_reference import hf_greedy, hf_model

TEXTS = ["The quick brown fox", "Hello world! This is", "one two three", "Paged attention stores"]
# (beam_width, length_penalty, max_tokens)
SETTINGS = [(2, 1.0, 12), (3, 0.0, 10), (4, 2.0, 12), (3, -0.5, 8)]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with a second eos: the fifth token of its greedy answer to TEXTS[0]."""
    path = tmp_path_factory.mktemp("beam") / "llama"
    shutil.copytree(tiny_checkpoints["llama"], path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    greedy = hf_greedy(str(tiny_checkpoints["llama"]), tokenizer.encode(TEXTS[0]), 8, stop_at_eos=False)
    config_path = path / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["eos_token_id"] = [tokenizer.eos_token_id, greedy.token_ids[4]]
    config_path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def llm(checkpoint: str) -> Iterator[LLM]:
    engine = LLM(checkpoint, multiprocess=False, max_model_len=256)
    yield engine
    engine.shutdown()


@torch.inference_mode()
def hf_beam_search(path: str, prompt: list[int], width: int, length_penalty: float, max_tokens: int):
    model = hf_model(path)
    out = model.generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=max_tokens,
        early_stopping="never",
        length_penalty=length_penalty,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    eos = set(model.generation_config.eos_token_id)
    sequences = []
    for row in out.sequences.tolist():
        generated = row[len(prompt) :]
        end = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
        sequences.append(generated[:end])  # (padding after an eos cut)
    return sequences, out.sequences_scores.tolist()


def test_beams_equal_transformers_beam_search(llm: LLM, checkpoint: str) -> None:
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in TEXTS]
    finish_reasons = set()
    for width, length_penalty, max_tokens in SETTINGS:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty)
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        for prompt, output in zip(prompts, outputs):
            expected, expected_scores = hf_beam_search(checkpoint, prompt, width, length_penalty, max_tokens)
            setting = (width, length_penalty, max_tokens, prompt)
            assert [s.tokens[: len(prompt)] for s in output.sequences] == [prompt] * width
            assert [s.tokens[len(prompt) :] for s in output.sequences] == expected, setting
            assert [s.score for s in output.sequences] == pytest.approx(expected_scores, abs=1e-4), setting
            scores = [s.score for s in output.sequences]
            assert scores == sorted(scores, reverse=True)
            for sequence in output.sequences:
                num_tokens = len(sequence.tokens) - len(prompt)
                assert sequence.score == pytest.approx(sequence.cum_logprob / num_tokens**length_penalty)
                assert len(sequence.logprobs) == num_tokens
                finish_reasons.add(sequence.finish_reason)
    assert finish_reasons == {"stop", "length"}  # beams ended on the eos and on max_tokens


@pytest.mark.parametrize(("length_penalty", "ignore_eos"), [(0.0, False), (1.0, True)])
def test_beam_width_1_is_greedy(llm: LLM, length_penalty: float, ignore_eos: bool) -> None:
    """Greedy decoding exactly where the two agree: scores without a length penalty (a longer
    beam may otherwise outscore the eos that greedy stops at), or no eos at all."""
    params = BeamSearchParams(beam_width=1, max_tokens=12, length_penalty=length_penalty, ignore_eos=ignore_eos)
    beams = llm.beam_search(TEXTS, params)
    greedy = llm.generate(TEXTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=ignore_eos), use_tqdm=False)
    stopped = 0
    for beam, sampled in zip(beams, greedy):
        [sequence] = beam.sequences
        completion = sampled.outputs[0]
        assert sequence.tokens == sampled.prompt_token_ids + completion.token_ids
        assert (sequence.text, sequence.finish_reason) == (completion.text, completion.finish_reason)
        stopped += completion.finish_reason == "stop"
    assert stopped == (0 if ignore_eos else 1)  # TEXTS[0]'s greedy answer has the second eos


def test_the_context_caps_max_tokens_and_bad_params_are_refused(llm: LLM) -> None:
    prompt = list(range(3, 3 + 250))  # 6 tokens of room in a context of 256
    [output] = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True))
    assert all(len(s.tokens) == 256 and s.finish_reason == "length" for s in output.sequences)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([list(range(3, 3 + 256))], BeamSearchParams(beam_width=2, max_tokens=4))
