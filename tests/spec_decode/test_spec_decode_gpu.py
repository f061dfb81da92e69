"""Speculative decoding on a GPU beside CUDA graphs: steps without drafts (speculation switched
off above `disable_by_batch_size`) replay the decode graphs, verification steps replay the
verification graphs (k + 1 tokens a request; eagerly on MLA models, so for MTP), and greedy
output equals the plain engine's (float32, so that the attention paths agree exactly), for every
method."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from shoal import LLM, SamplingParams

pytestmark = pytest.mark.gpu

ENGINE = dict(device="cuda", dtype="float32", multiprocess=False, max_num_seqs=8, gpu_memory_utilization=0.3)
# Batch sizes fall as requests finish: steps above the switch-off size replay decode graphs, the
# others verify (requests near max_tokens with fewer drafts: placeholders).
PARAMS = [SamplingParams(temperature=0.0, max_tokens=8 + 8 * i, ignore_eos=True) for i in range(6)]


def greedy(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(f"count {i}: one two three one two three")} for i in range(6)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def counted_replays(graphs: object) -> list[int]:
    """Count the runner's graph replays (the count in a one-item list)."""
    count = [0]
    replay = graphs.replay  # type: ignore[attr-defined]

    def counted(size: int, metadata: object = None) -> torch.Tensor:
        count[0] += 1
        return replay(size, metadata)

    graphs.replay = counted  # type: ignore[attr-defined]
    return count


def run(path: str, speculative_config: dict | None) -> tuple[list[list[int]], int, int | None, dict]:
    """Greedy tokens, decode and verification graph replays (None: no verification graphs) and
    stats of one engine (freed afterwards)."""
    llm = LLM(path, speculative_config=speculative_config, **ENGINE)
    runner = llm.engine_core.core.executor.worker.model_runner
    assert runner.cuda_graphs is not None
    decodes = counted_replays(runner.cuda_graphs)
    verifications = counted_replays(runner.verify_graphs) if runner.verify_graphs is not None else None
    tokens, stats = greedy(llm), llm.get_stats()
    del llm, runner
    gc.collect()  # counted_replays' wrappers make a cycle through the runner, and so its KV cache
    torch.cuda.empty_cache()
    return tokens, decodes[0], verifications[0] if verifications is not None else None, stats


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3", "mtp"])
def test_speculation_with_cuda_graphs_equals_plain_greedy(
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
    expected, _, _, _ = run(target, None)
    tokens, decode_replays, verify_replays, stats = run(target, config)
    assert tokens == expected
    assert decode_replays > 0  # the switched-off steps
    assert stats["spec_decode_num_drafts"] > 0  # and the others speculated
    if method == "mtp":
        assert verify_replays is None  # MLA verifies eagerly
    else:
        assert verify_replays is not None and verify_replays > 0


@pytest.mark.parametrize("keep_addresses", [True, False])
def test_verification_graphs_after_sleep_and_wake_up(keep_addresses: bool, tiny_checkpoints: dict) -> None:
    """Sleep drops the graphs where the addresses move and wake-up captures new ones, the
    verification graphs with the decode graphs; kept addresses keep them. Either way
    verification steps still replay them and greedy output is unchanged."""
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(tiny_checkpoints["llama"]), speculative_config=config, enable_sleep_mode=keep_addresses, **ENGINE)
    runner = llm.engine_core.core.executor.worker.model_runner
    expected = greedy(llm)
    graphs = runner.verify_graphs
    assert graphs is not None
    llm.sleep(level=1)
    llm.wake_up()
    assert runner.verify_graphs is not None and (runner.verify_graphs is graphs) == keep_addresses
    replays = counted_replays(runner.verify_graphs)
    assert greedy(llm) == expected
    assert replays[0] > 0
    llm.shutdown()
    del llm, runner, graphs
    torch.cuda.empty_cache()
