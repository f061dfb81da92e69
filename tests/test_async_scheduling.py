"""Async scheduling: the engine schedules step N+1 while step N runs, and the model runner
feeds step N's samples into step N+1 on the device. Outputs must not change: greedy equals
transformers (with chunked prefill, EOS stops and preemption), and every sampling feature gives
the same tokens as synchronous scheduling."""

from __future__ import annotations

import pytest

from shoal import LLM, SamplingParams
from shoal.config import EngineArgs
from tests.test_correctness import NUM_NEW_TOKENS, assert_matches_hf, prompts_for


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_async_scheduling_matches_hf_with_chunked_prefill(tiny_checkpoints: dict, kind: str) -> None:
    path = str(tiny_checkpoints[kind])
    llm = LLM(path, max_num_batched_tokens=24, max_num_seqs=8, block_size=4, async_scheduling=True)
    prompts = prompts_for(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == NUM_NEW_TOKENS for o in outputs)
    assert_matches_hf(path, outputs, prompts, stop_at_eos=False)
    stats = llm.get_stats()
    assert stats["num_used_blocks"] == 0
    # No step past max_tokens: prompts get at least 24 - 8 tokens of each step's budget beside at
    # most 8 decodes, then one step per output token.
    assert stats["num_steps"] <= NUM_NEW_TOKENS + -(-sum(len(p) for p in prompts) // (24 - 8)) + 1


def test_async_scheduling_stops_at_eos_like_hf(demo_model_path: str) -> None:
    llm = LLM(max_num_batched_tokens=40, max_num_seqs=8, async_scheduling=True)
    prompts = prompts_for(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert any(o.outputs[0].finish_reason == "stop" for o in outputs)
    assert_matches_hf(demo_model_path, outputs, prompts, stop_at_eos=True)
    assert llm.get_stats()["num_used_blocks"] == 0


def test_async_scheduling_with_preemption_matches_hf(tiny_checkpoints: dict) -> None:
    path = str(tiny_checkpoints["qwen3"])
    llm = LLM(
        path,
        block_size=4,
        num_gpu_blocks_override=25,
        max_model_len=100,
        max_num_batched_tokens=32,
        async_scheduling=True,
    )
    prompts = prompts_for(llm.get_tokenizer())
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["num_used_blocks"] == 0
    assert_matches_hf(path, outputs, prompts, stop_at_eos=False)


def test_async_scheduling_gives_the_same_tokens_for_every_sampling_feature(tiny_checkpoints: dict) -> None:
    path = str(tiny_checkpoints["llama"])
    features = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=12, logprobs=2),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=2, max_tokens=9),
        SamplingParams(temperature=0.7, min_p=0.1, seed=3, max_tokens=10, prompt_logprobs=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=12),
        SamplingParams(temperature=0.9, frequency_penalty=0.5, presence_penalty=0.4, seed=4, max_tokens=11),
        SamplingParams(temperature=0.0, min_tokens=6, max_tokens=8, stop_token_ids=[7, 11]),
        SamplingParams(temperature=0.6, n=2, seed=5, max_tokens=7),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(path, block_size=4, max_num_batched_tokens=32, async_scheduling=async_scheduling)
        prompts = prompts_for(llm.get_tokenizer(), len(features))
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], features, use_tqdm=False)
        results[async_scheduling] = outputs
        assert llm.get_stats()["num_used_blocks"] == 0
        del llm
    for sync, run_ahead in zip(results[False], results[True], strict=True):
        assert [(c.token_ids, c.finish_reason) for c in sync.outputs] == [
            (c.token_ids, c.finish_reason) for c in run_ahead.outputs
        ]
        # Steps batch differently, so float sums may differ in the last bits.
        for a, b in zip(sync.outputs, run_ahead.outputs):
            assert_same_logprobs(a.logprobs, b.logprobs)
        assert_same_logprobs(sync.prompt_logprobs, run_ahead.prompt_logprobs)
    assert results[True][0].outputs[0].logprobs and results[True][2].prompt_logprobs


def assert_same_logprobs(a: list | None, b: list | None) -> None:
    assert (a is None) == (b is None)
    for position_a, position_b in zip(a or [], b or [], strict=True):
        assert (position_a is None) == (position_b is None)
        if position_a is None:
            continue
        assert position_a.keys() == position_b.keys()
        for token_id, logprob in position_a.items():
            assert logprob.rank == position_b[token_id].rank
            assert logprob.logprob == pytest.approx(position_b[token_id].logprob, abs=1e-4)


def test_async_scheduling_default_and_validation(tiny_checkpoints: dict) -> None:
    path = str(tiny_checkpoints["llama"])
    assert not EngineArgs(path, device="cpu").create_engine_config().scheduler_config.async_scheduling
    assert (
        EngineArgs(path, device="cpu", async_scheduling=True).create_engine_config().scheduler_config.async_scheduling
    )
    with pytest.raises(ValueError, match="async_scheduling needs one worker"):
        EngineArgs(path, device="cpu", tensor_parallel_size=2, async_scheduling=True).create_engine_config()
