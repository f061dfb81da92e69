"""Speculative decoding in the engine (CPU): greedy output with speculation equals greedy output
without it, token for token, for every method (n-gram, a draft model, an EAGLE-3 head, DeepSeek's
MTP layer) with chunked prefill, prefix-cache hits, preemption, n=2, stops and max_tokens inside
accepted runs, logprobs, and a JSON-schema constraint; seeded sampling is reproducible; the
acceptance counters are reported; a bad config fails before anything loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from shoal import LLM, SamplingParams
from shoal.config import EngineArgs
from shoal.sampling_params import StructuredOutputsParams
from tests.hf_reference import hf_greedy
from tests.rl.rl_utils import WEIGHTS_FILE, noised, save_checkpoint

NUM_TOKENS = 24
TEXTS = [
    "one two three four five six seven eight nine ten one two three four five six seven eight",
    "The quick brown fox",
    "Paged attention stores keys and values in fixed-size blocks. Large language models generate text",
    "The lazy dog jumps over the quick brown fox and the fox jumps over the dog again and again",
    "Hello world! This is",
]
# Prompts longer than the budget are prefilled in chunks; blocks of 4 tokens fill quickly.
ENGINE: dict[str, Any] = dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=8, multiprocess=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_checkpoints: dict) -> str:
    return str(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def noisy_draft(target: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A draft model close to the target (its weights plus noise): it agrees with the target on
    some drafts and not on others, so verification accepts runs of every length."""
    weights = load_file(str(Path(target) / WEIGHTS_FILE))
    return save_checkpoint(target, tmp_path_factory.mktemp("draft"), noised(weights, seed=3, scale=0.005))


@pytest.fixture(scope="module")
def plain(target: str) -> LLM:
    return LLM(target, **ENGINE)


@pytest.fixture(scope="module")
def prompts(plain: LLM) -> list[dict]:
    tokenizer = plain.get_tokenizer()
    return [{"prompt_token_ids": tokenizer.encode(t)} for t in TEXTS]


def completions(llm: LLM, prompts: list[dict], params: SamplingParams | list[SamplingParams]) -> list[list[Any]]:
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


def token_ids(llm: LLM, prompts: list[dict], params: SamplingParams | list[SamplingParams] = GREEDY) -> list:
    return [[c.token_ids for c in outs] for outs in completions(llm, prompts, params)]


def spec_stats(llm: LLM) -> dict[str, Any]:
    return {k: v for k, v in llm.get_stats().items() if k.startswith("spec_decode")}


def spec_methods(target: str, noisy_draft: str, eagle3_head: Path) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "model": noisy_draft, "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "model": str(eagle3_head), "num_speculative_tokens": 2},
    }


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_greedy_output_equals_greedy_without_speculation(
    method: str, target: str, noisy_draft: str, eagle3_head: Path, plain: LLM, prompts: list[dict]
) -> None:
    """Chunked prefill, n=2, then the same prompts again (prefix-cache hits)."""
    params = SamplingParams(n=2, temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = token_ids(plain, prompts, params)
    config = spec_methods(target, noisy_draft, eagle3_head)[method]
    llm = LLM(target, speculative_config=config, **ENGINE)
    assert token_ids(llm, prompts, params) == expected
    stats = spec_stats(llm)
    assert stats["spec_decode_num_drafts"] > 0
    assert len(stats["spec_decode_num_accepted_tokens_per_pos"]) == config["num_speculative_tokens"]
    if method == "draft_model":  # (a random head, or prompt lookup on a random model, agrees by chance only)
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    hits_before = llm.get_stats()["prefix_cache_hits"]
    assert token_ids(llm, prompts, params) == expected
    assert llm.get_stats()["prefix_cache_hits"] > hits_before
    assert llm.get_stats()["num_used_blocks"] == 0


def test_preemption_with_a_draft_model(target: str, noisy_draft: str, plain: LLM, prompts: list[dict]) -> None:
    """A KV pool too small for the batch: requests are preempted (drafts dropped) and recomputed."""
    config = {"method": "draft_model", "model": noisy_draft, "num_speculative_tokens": 3}
    llm = LLM(target, speculative_config=config, **{**ENGINE, "num_gpu_blocks_override": 40, "max_model_len": 96})
    assert token_ids(llm, prompts) == token_ids(plain, prompts)
    assert llm.get_stats()["num_preemptions"] > 0


def test_mtp_greedy_output_equals_greedy_without_speculation(deepseek_mtp: Path) -> None:
    path = str(deepseek_mtp)
    base = LLM(path, **ENGINE)
    tokenizer = base.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(t)} for t in TEXTS[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = token_ids(base, prompts, params)
    llm = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **ENGINE)
    assert token_ids(llm, prompts, params) == expected
    assert spec_stats(llm)["spec_decode_num_draft_tokens"] > 0


@pytest.fixture(scope="module")
def self_drafted(target: str) -> LLM:
    """The target as its own draft model: every draft is accepted, so stops and max_tokens land
    inside accepted runs."""
    config = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    return LLM(target, speculative_config=config, **ENGINE)


def test_stops_and_max_tokens_inside_accepted_runs(self_drafted: LLM, plain: LLM, prompts: list[dict]) -> None:
    full = completions(plain, prompts[:2], GREEDY)
    first, second = full[0][0], full[1][0]
    stop_token = first.token_ids[6]
    stop_text = second.text[len(second.text) // 2 : len(second.text) // 2 + 3]
    params = [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, stop=[stop_text]),
    ]
    batch = [prompts[0], prompts[0], prompts[1]]
    before = spec_stats(self_drafted)
    ours = [c[0] for c in completions(self_drafted, batch, params)]
    theirs = [c[0] for c in completions(plain, batch, params)]
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert [c.text for c in ours] == [c.text for c in theirs]
    assert [c.finish_reason for c in ours] == ["length", "stop", "stop"]
    assert len(ours[0].token_ids) == 7 and ours[1].token_ids[-1] == stop_token
    for mine, reference in zip(ours[0].logprobs, theirs[0].logprobs):
        assert mine.keys() == reference.keys()
        for token_id in mine:
            assert mine[token_id].logprob == pytest.approx(reference[token_id].logprob, abs=1e-4)
    after = spec_stats(self_drafted)
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    assert (
        drafted > 0 and after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"] == drafted
    )


def test_json_schema_requests_draft_what_their_grammar_allows(
    self_drafted: LLM, plain: LLM, prompts: list[dict]
) -> None:
    """The target drafting for itself without the grammar: drafts the grammar refuses are cut
    before verification, those it allows (inside the string) are verified against the masked
    rows; the output is the constrained greedy output, batched with free requests."""
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    structured = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema))
    before = spec_stats(self_drafted)
    assert token_ids(self_drafted, prompts[:2], structured) == token_ids(plain, prompts[:2], structured)
    after = spec_stats(self_drafted)
    assert after["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]
    batch, params = prompts[:3], [structured, structured, GREEDY]
    assert token_ids(self_drafted, batch, params) == token_ids(plain, batch, params)


def test_seeded_sampling_is_reproducible(target: str, noisy_draft: str, prompts: list[dict]) -> None:
    config = {"method": "draft_model", "model": noisy_draft, "num_speculative_tokens": 3}
    llm = LLM(target, speculative_config=config, **ENGINE)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=NUM_TOKENS, ignore_eos=True)
    first = [c[0].text for c in completions(llm, prompts[:3], params)]
    second = [c[0].text for c in completions(llm, prompts[:3][::-1], params)][::-1]  # other batch order
    assert first == second
    assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0


def test_bad_configs_fail_before_anything_loads(target: str, noisy_draft: str) -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        EngineArgs(target, speculative_config={"method": "medusa", "num_speculative_tokens": 2}).create_engine_config()
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineArgs(target, speculative_config="{method: ngram").create_engine_config()
    with pytest.raises(ValueError, match="pipeline parallelism"):
        EngineArgs(
            target,
            pipeline_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        ).create_engine_config()
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be the target's"):
        draft = {"method": "draft_model", "model": noisy_draft, "num_speculative_tokens": 2}
        EngineArgs(
            target, tensor_parallel_size=2, speculative_config={**draft, "draft_tensor_parallel_size": 1}
        ).create_engine_config()
    config = EngineArgs(
        target, async_scheduling=True, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}'
    ).create_engine_config()
    assert config.speculative_config is not None and config.speculative_config.prompt_lookup_max == 5
    assert not config.scheduler_config.async_scheduling  # turned off, with a log line


def test_speculative_config_flag(target: str) -> None:
    from shoal.cli import engine_args_from, make_parser

    flag = '{"method": "ngram", "num_speculative_tokens": 4}'
    for command in (["serve", target], ["batch", "-i", "in.jsonl", "-o", "out.jsonl", "--model", target]):
        args = make_parser().parse_args([*command, "--speculative-config", flag])
        config = engine_args_from(args).create_engine_config().speculative_config
        assert config is not None and config.num_speculative_tokens == 4


PASSAGE = "The river rises in the hills above the town, runs through the old market square and reaches the sea."


def test_demo_model_ngram_on_a_copy_heavy_prompt(demo_model_path: str) -> None:
    """Prompt lookup on a real model asked to repeat a passage: drafts are accepted, the
    acceptance rate and mean accepted length are reported, and the output is greedy's
    (transformers' greedy tokens on the same weights)."""
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(demo_model_path, speculative_config=config, max_model_len=256, multiprocess=False)
    prompt = llm.get_tokenizer().encode(f"Repeat this passage word for word.\n\n{PASSAGE}\n\nThe passage again:\n\n")
    params = SamplingParams(temperature=0.0, max_tokens=16)
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert output.token_ids == hf_greedy(demo_model_path, prompt, 16, stop_at_eos=True).token_ids
    stats = spec_stats(llm)
    acceptance_rate = stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"]
    mean_accepted_length = 1 + stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_drafts"]
    print(
        f"demo model, n-gram k=4: acceptance rate {acceptance_rate:.2f}, mean accepted length {mean_accepted_length:.2f}"
    )
    assert acceptance_rate > 0 and mean_accepted_length > 1


def test_tensor_parallel_through_ray(
    ray_cluster: dict, target: str, noisy_draft: str, prompts: list[dict], plain: LLM
) -> None:
    """TP=2: the draft model sharded like the target runs on both ranks, on the tokens the
    sampling rank emitted."""
    config = {"method": "draft_model", "model": noisy_draft, "num_speculative_tokens": 3}
    llm = LLM(target, tensor_parallel_size=2, speculative_config=config, **ENGINE)
    try:
        assert token_ids(llm, prompts) == token_ids(plain, prompts)
        assert spec_stats(llm)["spec_decode_num_accepted_tokens"] > 0
    finally:
        llm.shutdown()


def test_rl_weight_update_reaches_the_draft_model(target: str, noisy_draft: str, tmp_path: Path) -> None:
    """A trainer's step updates the target and, by its `draft_model.` names, the draft model:
    after sleep(level=2) (both models' weights and KV caches freed), a wake-up of the weights, the
    update and a wake-up of the KV caches, the
    output is transformers' greedy output on the new weights, and the draft model, now the new
    target itself, has every draft accepted."""
    config = {"method": "draft_model", "model": noisy_draft, "num_speculative_tokens": 3}
    llm = LLM(target, speculative_config=config, **ENGINE)
    prompt = llm.get_tokenizer().encode(TEXTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    before = spec_stats(llm)
    assert before["spec_decode_num_accepted_tokens"] < before["spec_decode_num_draft_tokens"]

    new = noised(load_file(str(Path(target) / WEIGHTS_FILE)), seed=1)
    new_path = save_checkpoint(target, tmp_path / "trained", new)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.update_weights_from_tensors({**new, **{f"draft_model.{name}": t for name, t in new.items()}})
    llm.wake_up(tags=["kv_cache"])
    output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert output.token_ids == hf_greedy(new_path, prompt, 12, stop_at_eos=False).token_ids
    after = spec_stats(llm)
    num_draft_tokens = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    assert num_draft_tokens > 0
    assert after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"] == num_draft_tokens
