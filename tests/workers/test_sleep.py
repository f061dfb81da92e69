"""Sleep and wake-up on CPU: the KV cache (and at level 2 the weights) really leave memory,
greedy outputs are the same after waking, tags wake one at a time, and a sleeping engine
refuses synchronous generation instead of waiting forever."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal import LLM, SamplingParams
from shoal.errors import GenerationHeldError
from shoal.models.loader import iterate_safetensors
from tests.checkpoints import make_checkpoint
from tests.hf_reference import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3], [250, 251, 7], list(range(30, 52))]


@pytest.fixture(scope="module")
def llm(tiny_checkpoints: dict) -> Iterator[LLM]:
    engine = LLM(str(tiny_checkpoints["llama"]), multiprocess=False, max_num_seqs=8, max_model_len=128)
    yield engine
    engine.shutdown()


def greedy_tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def expected(llm: LLM) -> list[list[int]]:
    return greedy_tokens(llm)


def resident(llm: LLM) -> dict[str, int]:
    (report,) = llm.collective_rpc("resident_bytes")
    return report


def test_level_1_releases_the_kv_cache_and_wakes_up_to_the_same_outputs(llm: LLM, expected: list) -> None:
    awake = resident(llm)
    assert awake["kv_cache"] > 0 and awake["weights"] > 0
    llm.sleep(level=1)
    assert llm.is_sleeping()
    asleep = resident(llm)
    assert asleep["kv_cache"] == 0
    assert asleep["weights"] == awake["weights"]  # on a CPU the weights already live in host memory
    with pytest.raises(GenerationHeldError, match="asleep"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping() and resident(llm) == awake
    assert greedy_tokens(llm) == expected
    assert llm.get_stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("order", [["weights", "kv_cache"], ["kv_cache", "weights"]])
def test_tags_wake_up_one_at_a_time(llm: LLM, expected: list, order: list[str]) -> None:
    llm.sleep(level=1)
    llm.wake_up(tags=[order[0]])
    assert llm.is_sleeping()
    assert (resident(llm)["kv_cache"] > 0) == (order[0] == "kv_cache")
    with pytest.raises(GenerationHeldError, match=order[1]):
        llm.generate("hello", GREEDY, use_tqdm=False)
    llm.wake_up(tags=[order[1]])
    assert not llm.is_sleeping()
    assert greedy_tokens(llm) == expected


def test_bad_level_and_tags_are_value_errors_and_change_nothing(llm: LLM, expected: list) -> None:
    with pytest.raises(ValueError, match="sleep level"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        llm.wake_up(tags=["activations"])
    assert not llm.is_sleeping()
    assert greedy_tokens(llm) == expected


def test_level_2_discards_the_weights_and_generation_waits_for_new_ones(
    llm: LLM, expected: list, tmp_path: Path
) -> None:
    """New weights come back by an update; the test loads them through the model's own
    weight_loaders and advances the version, as an update does."""
    new_weights = make_checkpoint("llama", tmp_path / "new", seed=1)
    llm.sleep(level=2)
    assert resident(llm) == {"weights": 0, "kv_cache": 0}
    llm.wake_up(tags=["weights"])
    assert resident(llm)["weights"] > 0
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    with pytest.raises(GenerationHeldError, match="discarded"):
        llm.generate("hello", GREEDY, use_tqdm=False)

    def update(path: Path) -> None:  # as an update does: load, reset the prefix cache, advance
        llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(iterate_safetensors(str(path))))
        llm.reset_prefix_cache()
        llm.engine_core.core.scheduler.advance_weight_version(path.name)

    update(new_weights)
    tokens = greedy_tokens(llm)
    assert tokens == [hf_greedy(str(new_weights), p, 12, stop_at_eos=False).token_ids for p in PROMPTS]
    assert tokens != expected

    update(Path(llm.config.model_config.model))  # the module's weights again
    assert greedy_tokens(llm) == expected


def test_sync_generate_refuses_while_paused(llm: LLM, expected: list) -> None:
    llm.pause_generation(mode="keep")
    assert llm.is_paused()
    with pytest.raises(GenerationHeldError, match="paused"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    llm.resume_generation()
    assert not llm.is_paused()
    assert greedy_tokens(llm) == expected
