"""Greedy shoal equals Hugging Face transformers token for token (float32, CPU).

Eight prompts of different lengths run together under a token budget small enough to chunk
their prefills; top-5 logprobs must agree to 1e-4. Also: prefix-cache hits and preemption
leave the outputs unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest

from shoal import LLM, SamplingParams
from tests.hf_reference import hf_greedy

NUM_NEW_TOKENS = 32
TEXTS = [
    "The quick brown fox",
    "Hello world! This is",
    "Paged attention stores keys and values in fixed-size blocks. Large language models generate text",
    "one two three four five six seven eight nine ten one two three four five six seven eight",
    "Hello",
    "The lazy dog jumps over the quick brown fox and the fox jumps over the dog again and again",
    "seven eight nine",
    "Large language models generate text one token at a time. The quick brown",
]


def prompts_for(tokenizer: Any, count: int = len(TEXTS)) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS[:count]]


def assert_matches_hf(path: str, outputs: list, prompts: list[list[int]], stop_at_eos: bool) -> None:
    for prompt, output in zip(prompts, outputs):
        expected = hf_greedy(path, prompt, NUM_NEW_TOKENS, stop_at_eos)
        completion = output.outputs[0]
        assert completion.token_ids == expected.token_ids, f"prompt {prompt}"
        if completion.logprobs is None:
            continue
        for position, (ours, theirs) in enumerate(zip(completion.logprobs, expected.top_logprobs)):
            for token_id, logprob in theirs.items():
                assert token_id in ours, f"position {position}: top token {token_id} missing"
                assert ours[token_id].logprob == pytest.approx(logprob, abs=1e-4)


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_tiny_models_match_hf_with_chunked_prefill(tiny_checkpoints: dict, kind: str) -> None:
    path = str(tiny_checkpoints[kind])
    llm = LLM(path, max_num_batched_tokens=24, max_num_seqs=8, block_size=4)
    prompts = prompts_for(llm.get_tokenizer())
    assert max(len(p) for p in prompts) > 24  # the longest prompt really is chunked
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == NUM_NEW_TOKENS for o in outputs)
    assert_matches_hf(path, outputs, prompts, stop_at_eos=False)
    assert llm.get_stats()["num_used_blocks"] == 0


def test_demo_model_matches_hf(demo_model_path: str) -> None:
    llm = LLM(max_num_batched_tokens=40, max_num_seqs=8)
    prompts = prompts_for(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert sum(len(o.outputs[0].token_ids) for o in outputs) >= 4 * NUM_NEW_TOKENS
    assert_matches_hf(demo_model_path, outputs, prompts, stop_at_eos=True)


def test_prefix_cache_hits_give_the_same_output(tiny_checkpoints: dict) -> None:
    path = str(tiny_checkpoints["llama"])
    llm = LLM(path, block_size=4, max_num_batched_tokens=64)
    tokenizer = llm.get_tokenizer()
    prefix = tokenizer.encode(TEXTS[2] + " " + TEXTS[3])
    suffixes = [tokenizer.encode(" " + t) for t in ("Hello", "seven eight", "The quick")]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prefix + suffixes[0]}], params, use_tqdm=False)
    before = llm.get_stats()
    second = llm.generate([{"prompt_token_ids": prefix + s} for s in suffixes], params, use_tqdm=False)
    after = llm.get_stats()
    full_blocks = len(prefix) // 4
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 3 * full_blocks * 4
    assert second[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert second[0].num_cached_tokens >= full_blocks * 4
    fresh = LLM(path, block_size=4, enable_prefix_caching=False)
    expected = fresh.generate([{"prompt_token_ids": prefix + s} for s in suffixes], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in expected]


def test_kv_cache_smaller_than_one_sequence_is_refused(tiny_checkpoints: dict) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_checkpoints["llama"]), block_size=4, num_gpu_blocks_override=14, max_model_len=64)


def test_preemption_keeps_outputs_equal_to_hf(tiny_checkpoints: dict) -> None:
    path = str(tiny_checkpoints["qwen3"])
    # 25 blocks of 4 tokens cannot hold eight sequences of up to 97 tokens: requests get preempted.
    llm = LLM(path, block_size=4, num_gpu_blocks_override=25, max_model_len=100, max_num_batched_tokens=32)
    prompts = prompts_for(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_used_blocks"] == 0
    assert_matches_hf(path, outputs, prompts, stop_at_eos=False)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_models_match_hf_with_chunked_prefill_preemption_and_prefix_hits(moe_checkpoints: dict, kind: str) -> None:
    """Eight prompts with chunked prefills in a cache too small for all of them (preemption),
    then the same prompts again, their prefixes now cached: every run equals transformers."""
    check_chunked_prefill_preemption_and_prefix_hits(str(moe_checkpoints[kind]))


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_models_match_hf_with_chunked_prefill_preemption_and_prefix_hits(
    deepseek_checkpoints: dict, kind: str
) -> None:
    """The same for multi-head latent attention: chunks after a cached prefix and resumed
    requests read their context's latents back from the cache; decodes run absorbed."""
    check_chunked_prefill_preemption_and_prefix_hits(str(deepseek_checkpoints[kind]))


def check_chunked_prefill_preemption_and_prefix_hits(path: str) -> None:
    llm = LLM(path, block_size=4, num_gpu_blocks_override=40, max_model_len=100, max_num_batched_tokens=24)
    prompts = prompts_for(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and max(len(p) for p in prompts) > 24
    assert_matches_hf(path, first, prompts, stop_at_eos=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    assert llm.get_stats()["prefix_cache_hits"] > stats["prefix_cache_hits"]
    for ours, before in zip(again, first):
        assert ours.outputs[0].token_ids == before.outputs[0].token_ids  # which matched transformers
        for a, b in zip(ours.outputs[0].logprobs, before.outputs[0].logprobs):
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in b)
    assert llm.get_stats()["num_used_blocks"] == 0
