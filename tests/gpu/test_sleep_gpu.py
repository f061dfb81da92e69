"""sleep / wake_up on one GPU, for both ways of getting the memory back: keeping the addresses
(`enable_sleep_mode`, the VMM allocator) and recapturing the CUDA graphs. sleep(level=1) frees
at least 90% of the engine's GPU memory as the driver sees it, wake_up restores it, greedy
outputs are identical before and after, and decode still replays CUDA graphs (the same ones when
the addresses are kept). Level 2 then new weights gives transformers' output on them.

Figures (sleep and wake times, an 8B-shaped model) come from tests/gpu/sleep_wake.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.models.loader import iterate_safetensors
from tests.checkpoints import make_checkpoint
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5 + i, 17, 42, 99, 3 + 2 * i] * (1 + i % 3) for i in range(12)]
STRATEGIES = {"keep_addresses": True, "recapture": False}


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.fixture(scope="module", params=list(STRATEGIES))
def engine(request: pytest.FixtureRequest, tiny_checkpoints: dict) -> Iterator[tuple[LLM, int]]:
    """(the engine, the device memory it holds as the driver sees it)."""
    torch.cuda.init()
    torch.cuda.empty_cache()
    before = free_bytes()
    llm = LLM(
        str(tiny_checkpoints["llama"]),
        device="cuda",
        dtype="float32",
        multiprocess=False,
        gpu_memory_utilization=0.3,
        max_num_seqs=16,
        enable_sleep_mode=STRATEGIES[request.param],
    )
    yield llm, before - free_bytes()
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()


def runner(llm: LLM):
    return llm.engine_core.core.executor.worker.model_runner


def greedy(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def count_replays(llm: LLM) -> list[int]:
    """Wrap the current graphs' replay; the returned list grows by one per replay."""
    graphs = runner(llm).cuda_graphs
    assert graphs is not None
    calls: list[int] = []
    replay = graphs.replay

    def counted(size: int) -> torch.Tensor:
        calls.append(size)
        return replay(size)

    graphs.replay = counted  # type: ignore[method-assign]
    return calls


def test_level_1_frees_90_percent_and_wake_up_restores_it_with_identical_outputs(engine: tuple[LLM, int]) -> None:
    llm, engine_bytes = engine
    keeps_addresses = llm.engine_core.core.executor.worker.sleeper.strategy.keeps_addresses
    assert keeps_addresses == llm.config.model_config.enable_sleep_mode
    expected = greedy(llm)
    graphs, weight_ptr = runner(llm).cuda_graphs, next(runner(llm).model.parameters()).data_ptr()
    awake = free_bytes()
    llm.sleep(level=1)
    freed = free_bytes() - awake
    assert freed >= 0.9 * engine_bytes, (freed, engine_bytes)
    llm.wake_up()
    assert abs(free_bytes() - awake) <= 0.02 * engine_bytes
    replays = count_replays(llm)
    assert greedy(llm) == expected
    assert replays, "decode did not replay CUDA graphs after the wake-up"
    if keeps_addresses:  # the same graphs, the same addresses
        assert runner(llm).cuda_graphs is graphs
        assert next(runner(llm).model.parameters()).data_ptr() == weight_ptr
    else:
        assert runner(llm).cuda_graphs is not graphs


def test_tags_wake_up_one_at_a_time(engine: tuple[LLM, int]) -> None:
    llm, engine_bytes = engine
    expected = greedy(llm)
    awake = free_bytes()
    llm.sleep(level=1)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping() and free_bytes() - awake >= 0.8 * engine_bytes  # the KV cache is still out
    llm.wake_up(tags=["kv_cache"])
    assert greedy(llm) == expected


def test_level_2_then_new_weights_gives_transformers_output(engine: tuple[LLM, int], tmp_path: Path) -> None:
    llm, engine_bytes = engine
    new_weights = make_checkpoint("llama", tmp_path / "new", seed=3)
    awake = free_bytes()
    llm.sleep(level=2)
    assert free_bytes() - awake >= 0.9 * engine_bytes
    llm.wake_up(tags=["weights"])
    # As an update does: load through the weight_loaders, reset the prefix cache, advance.
    llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(iterate_safetensors(str(new_weights))))
    llm.reset_prefix_cache()
    llm.engine_core.core.scheduler.advance_weight_version("new")
    llm.wake_up(tags=["kv_cache"])
    want = [hf_greedy(str(new_weights), p, GREEDY.max_tokens, stop_at_eos=False).token_ids for p in PROMPTS]
    assert greedy(llm) == want
    # the module's weights again, for the tests after this one
    old = llm.config.model_config.model
    llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(iterate_safetensors(old)))
    llm.reset_prefix_cache()
