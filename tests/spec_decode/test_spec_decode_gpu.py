"""Speculative decoding on a GPU beside the decode CUDA graphs: steps without drafts (speculation
switched off above `disable_by_batch_size`) replay the graphs, verification steps run eagerly,
and greedy output equals the plain engine's (float32, so that the two attention paths agree
exactly), for every method."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal import LLM, SamplingParams

pytestmark = pytest.mark.gpu

ENGINE = dict(device="cuda", dtype="float32", multiprocess=False, max_num_seqs=8, gpu_memory_utilization=0.3)
# Batch sizes fall as requests finish: steps above the switch-off size replay graphs.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=8 + 8 * i, ignore_eos=True) for i in range(6)]


def greedy(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(f"count {i}: one two three one two three")} for i in range(6)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def run(path: str, speculative_config: dict | None) -> tuple[list[list[int]], int, dict]:
    """Greedy tokens, graph replays and stats of one engine (freed afterwards)."""
    llm = LLM(path, speculative_config=speculative_config, **ENGINE)
    graphs = llm.engine_core.core.executor.worker.model_runner.cuda_graphs
    assert graphs is not None
    replays = 0
    replay = graphs.replay

    def counted(size: int) -> torch.Tensor:
        nonlocal replays
        replays += 1
        return replay(size)

    graphs.replay = counted
    tokens, stats = greedy(llm), llm.get_stats()
    del llm, graphs
    torch.cuda.empty_cache()
    return tokens, replays, stats


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3", "mtp"])
def test_speculation_beside_decode_graphs_equals_plain_greedy(
    method: str, tiny_checkpoints: dict, eagle3_head: Path, deepseek_mtp: Path
) -> None:
    target = str(deepseek_mtp if method == "mtp" else tiny_checkpoints["llama"])
    config: dict = {"method": method, "num_speculative_tokens": 2, "disable_by_batch_size": 3}
    if method == "ngram":
        config.update(prompt_lookup_min=1, prompt_lookup_max=3)
    elif method == "draft_model":
        config["model"] = target
    elif method == "eagle3":
        config["model"] = str(eagle3_head)
    expected, _, _ = run(target, None)
    tokens, replays, stats = run(target, config)
    assert tokens == expected
    assert replays > 0  # the switched-off steps
    assert stats["spec_decode_num_drafts"] > 0  # and the others speculated
