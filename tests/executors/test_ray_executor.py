"""Tensor and pipeline parallelism on Ray actors (CPU, gloo): greedy tokens equal TP=1 and
Hugging Face transformers, with one batch in flight per pipeline stage; collective_rpc answers
in rank order.

Every engine joins the session's Ray cluster (`ray_cluster`, 4 logical CPUs).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from shoal import LLM, SamplingParams
from tests.hf_reference import hf_greedy

NUM_NEW_TOKENS = 12
TEXTS = [
    "The quick brown fox",
    "Hello world! This is",
    "Paged attention stores keys and values in fixed-size blocks. Large language models",
    "one two three four five six seven eight nine ten one two three",
]
# Small pages and a small step budget: prefills are chunked and pipeline batches interleave.
ENGINE_ARGS: dict[str, Any] = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=8, multiprocess=False)
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=3, prompt_logprobs=2)


def prompts(llm: LLM) -> list[list[int]]:
    return [llm.get_tokenizer().encode(t) for t in TEXTS]


@cache
def reference(path: str) -> tuple[list[list[int]], list]:
    """(prompts, outputs) of the single-process engine (TP=1, PP=1) on `path`."""
    llm = LLM(path, **ENGINE_ARGS)
    prompt_ids = prompts(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], PARAMS, use_tqdm=False)
    llm.shutdown()
    return prompt_ids, outputs


def assert_close_logprobs(ours: list, theirs: list) -> None:
    """Per position {token id: Logprob}; tensor parallelism sums in another order, so 1e-4."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        if a is None or b is None:  # prompt position 0 has no logprob
            assert a is b
            continue
        assert set(a) == set(b)
        for token_id in a:
            assert a[token_id].logprob == pytest.approx(b[token_id].logprob, abs=1e-4)


@cache
def hf_tokens(path: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(path, list(prompt), NUM_NEW_TOKENS, stop_at_eos=False).token_ids


def assert_matches_reference(path: str, outputs: list) -> None:
    prompt_ids, expected = reference(path)
    for prompt, ours, theirs in zip(prompt_ids, outputs, expected):
        assert ours.outputs[0].token_ids == hf_tokens(path, tuple(prompt))
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert_close_logprobs(ours.outputs[0].logprobs, theirs.outputs[0].logprobs)
        assert_close_logprobs(ours.prompt_logprobs, theirs.prompt_logprobs)


class BatchQueueProbe:
    """Records how many batches the engine core had in flight whenever it launched one."""

    def __init__(self, llm: LLM) -> None:
        self.core = llm.engine_core.core
        self.max_in_flight = 0
        executor = self.core.executor
        launch = executor.execute_model

        def execute_model(scheduler_output, non_block=False):
            result = launch(scheduler_output, non_block)
            self.max_in_flight = max(self.max_in_flight, len(self.core.batch_queue or ()) + 1)
            return result

        executor.execute_model = execute_model


@pytest.mark.parametrize(
    ("kind", "tp", "pp"),
    [
        ("llama", 2, 1),
        ("qwen2", 2, 1),
        ("qwen3", 2, 1),
        ("llama_odd_vocab", 2, 1),
        ("llama", 1, 2),
        ("qwen2", 1, 2),  # tied embeddings: the last stage loads its own copy of the head
        ("qwen3", 1, 2),
        ("qwen2", 2, 2),
    ],
)
def test_parallel_greedy_matches_tp1_and_hf(ray_cluster: dict, tiny_checkpoints: dict, kind: str, tp: int, pp: int):
    path = str(tiny_checkpoints[kind])
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE_ARGS)
    try:
        check_generation(llm, path, pp)
    finally:
        llm.shutdown()


MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
# TP=2 splits every expert's intermediate dimension (and MLA's heads); PP=2 gives each stage its
# layers; expert parallelism puts experts 0-3 on rank 0 and 4-7 on rank 1 (shared experts split).
MOE_LAYOUTS = [
    pytest.param(2, 1, False, id="tp2"),
    pytest.param(1, 2, False, id="pp2"),
    pytest.param(2, 1, True, id="ep2"),
]


@pytest.mark.parametrize(("tp", "pp", "expert_parallel"), MOE_LAYOUTS)
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_parallel_greedy_matches_tp1_and_hf(
    request: pytest.FixtureRequest, ray_cluster: dict, kind: str, tp: int, pp: int, expert_parallel: bool
):
    checkpoints = request.getfixturevalue("deepseek_checkpoints" if kind.startswith("deepseek") else "moe_checkpoints")
    path = str(checkpoints[kind])
    llm = LLM(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=expert_parallel, **ENGINE_ARGS
    )
    try:
        assert llm.engine_core.core.executor.config.parallel_config.enable_expert_parallel == expert_parallel
        check_generation(llm, path, pp)
        # Lambdas travel to the workers by value (the workers cannot import this module).
        experts = llm.collective_rpc(
            lambda w: next(
                m.num_local_experts for m in w.model_runner.model.modules() if hasattr(m, "num_local_experts")
            )
        )
        assert experts == ([4, 4] if expert_parallel else [8] * tp * pp)
        if tp == 2 and kind.startswith("deepseek"):
            heads = llm.collective_rpc(lambda w: w.model_runner.model.model.layers["0"].self_attn.num_heads)
            assert heads == [2, 2]
    finally:
        llm.shutdown()


def check_generation(llm: LLM, path: str, pp: int) -> None:
    probe = BatchQueueProbe(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(llm)], PARAMS, use_tqdm=False)
    assert_matches_reference(path, outputs)
    # Pipeline parallelism keeps one batch in flight per stage.
    assert probe.max_in_flight == pp
    assert llm.get_stats()["num_used_blocks"] == 0


@pytest.fixture(scope="module")
def odd_vocab_tp2_pp2(ray_cluster: dict, tiny_checkpoints: dict) -> Iterator[tuple[LLM, str]]:
    """Vocabulary 1001, one KV head for two ranks, one layer a stage: TP=2 x PP=2."""
    path = str(tiny_checkpoints["llama_odd_vocab"])
    llm = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE_ARGS)
    yield llm, path
    llm.shutdown()


def test_tp2_pp2_odd_vocab_matches_tp1_and_hf(odd_vocab_tp2_pp2: tuple[LLM, str]) -> None:
    llm, path = odd_vocab_tp2_pp2
    check_generation(llm, path, pp=2)


def test_collective_rpc_answers_in_rank_order(odd_vocab_tp2_pp2: tuple[LLM, str]) -> None:
    llm, _ = odd_vocab_tp2_pp2

    def placement(worker: Any) -> tuple[int, int, int, int]:
        from shoal.distributed.parallel_state import get_pp_group, get_tp_group

        stage = worker.model_runner.model.model
        return worker.rank, get_tp_group().rank_in_group, get_pp_group().rank_in_group, stage.start_layer

    # Rank = pp_rank * tp + tp_rank; the checkpoint's 2 layers split 1 + 1.
    assert llm.collective_rpc(placement) == [(0, 0, 0, 0), (1, 1, 0, 0), (2, 0, 1, 1), (3, 1, 1, 1)]
    executor = llm.engine_core.core.executor
    node = executor.worker_node_ids[0]
    assert llm.collective_rpc("report_device") == [f"cpu:{node}:{i}" for i in executor.bundle_indices]
    assert llm.collective_rpc("check_health", timeout=30) == [True] * 4
    assert [len(stage) for stage in executor.stage_workers] == [2, 2]
    with pytest.raises(ValueError, match="no method"):
        llm.collective_rpc("not_a_method")


def test_profile_on_every_ray_worker(odd_vocab_tp2_pp2: tuple[LLM, str], tmp_path: Path) -> None:
    """start_profile / stop_profile reach each worker actor: one trace per rank, of its own ops."""
    llm, _ = odd_vocab_tp2_pp2
    llm.start_profile(str(tmp_path))
    llm.generate(["one two three"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    summaries = llm.stop_profile()
    assert [s["rank"] for s in summaries] == [0, 1, 2, 3]
    traces = [Path(s["trace"]) for s in summaries]
    assert len(set(traces)) == 4 and all(t.parent == tmp_path and t.stat().st_size > 0 for t in traces)
    assert all("aten::" in s["table"] and s["device_busy_s"] is None for s in summaries)
