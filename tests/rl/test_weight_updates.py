"""Weight updates into a single-worker engine (its core in its own process, so the tensors
cross the utility-call path as bytes): from tensors and from disk the greedy output becomes that
of Hugging Face transformers on the new weights; a wrong name, shape or dtype is a ValueError
naming it and changes nothing; sleep(level=2) then an update then wake_up serves the new
weights; an update between pause(mode="keep") and resume shows in `weight_versions`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shoal import LLM, SamplingParams
from shoal.config import EngineArgs
from shoal.frontend.async_llm import AsyncLLM
from shoal.outputs import WeightVersionSpan
from tests.hf_reference import hf_greedy
from tests.rl.rl_utils import WEIGHTS_FILE, noised, save_checkpoint

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3], list(range(30, 44))]
ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=4)
SMALL_BUCKET_BYTES = 64 << 10  # the tiny Llama's 30 tensors (~400 KB) in several buckets


@pytest.fixture(scope="module")
def original(tiny_checkpoints: dict) -> str:
    return str(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def weights(original: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(original) / WEIGHTS_FILE))


@pytest.fixture(scope="module")
def changed(original: str, weights: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """A "trained" checkpoint: (its folder, its tensors)."""
    new = noised(weights, seed=1)
    return save_checkpoint(original, tmp_path_factory.mktemp("changed"), new), new


@pytest.fixture(scope="module")
def llm(original: str) -> Iterator[LLM]:
    with LLM(original, **ENGINE_ARGS) as engine:
        yield engine


def generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def hf_tokens(path: str) -> list[list[int]]:
    return [hf_greedy(path, p, NUM_TOKENS, stop_at_eos=False).token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def before(llm: LLM, original: str) -> list[list[int]]:
    tokens = generate(llm)
    assert tokens == hf_tokens(original)
    return tokens


def test_update_from_tensors_then_from_disk(llm: LLM, before: list, changed: tuple, original: str) -> None:
    path, tensors = changed
    expected = hf_tokens(path)
    assert expected != before
    assert llm.update_weights_from_tensors(tensors, bucket_bytes=SMALL_BUCKET_BYTES) == "1"
    assert generate(llm) == expected
    assert llm.update_weights_from_disk(original, weight_version="original") == "original"
    assert llm.weight_version == "original"
    assert generate(llm) == before
    llm.update_weights_from_disk(path)
    assert generate(llm) == expected
    llm.update_weights_from_disk(original)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"model.layers.0.mlp.gate.weight": torch.zeros(128, 64)}, "unknown weight 'model.layers.0.mlp.gate.weight'"),
        (
            {"model.layers.1.self_attn.q_proj.weight": torch.zeros(32, 64)},
            "'model.layers.1.self_attn.q_proj.weight' has shape \\[32, 64\\], the model's is \\[64, 64\\]",
        ),
        ({"model.norm.weight": torch.zeros(64, dtype=torch.bfloat16)}, "'model.norm.weight' has dtype bfloat16"),
    ],
    ids=["name", "shape", "dtype"],
)
def test_a_bad_tensor_is_refused_and_nothing_changes(
    llm: LLM, before: list, changed: tuple, bad: dict, message: str
) -> None:
    """The good tensors before the bad one are not written either: the batch is checked first."""
    version = llm.weight_version
    _, tensors = changed
    with pytest.raises(ValueError, match=message):
        llm.update_weights_from_tensors({**tensors, **bad}, bucket_bytes=SMALL_BUCKET_BYTES)
    assert llm.weight_version == version
    assert generate(llm) == before


def test_a_bad_folder_is_refused(llm: LLM, before: list, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        llm.update_weights_from_disk(str(tmp_path))
    assert generate(llm) == before


def test_an_update_in_several_calls_holds_generation_until_the_last(llm: LLM, changed: tuple, original: str) -> None:
    """The shape of a CUDA-IPC update (one bucket a call), here with CPU buckets: no step may
    run on half-written weights, and the version advances with the last call."""
    from shoal.rl.tensor_transfer import cpu_bucket, encode_metas, plan_tensor_buckets

    path, tensors = changed
    named = list(tensors.items())
    llm.engine_core.call_utility("check_weights", encode_metas(named))
    with pytest.raises(ValueError, match=r"unknown weight 'lm_head\.bias'"):
        llm.engine_core.call_utility("check_weights", encode_metas([("lm_head.bias", named[0][1])]))
    buckets = [cpu_bucket(b) for b in plan_tensor_buckets(named, SMALL_BUCKET_BYTES)]
    assert len(buckets) >= 2
    for bucket in buckets[:-1]:
        llm.engine_core.call_utility("update_weights_from_tensors", [bucket], "multi", True, False)
        assert "half updated" in llm.engine_core.call_utility("generation_hold")
    assert llm.engine_core.call_utility("update_weights_from_tensors", [buckets[-1]], "multi", True, True) == "multi"
    assert llm.engine_core.call_utility("generation_hold") is None
    assert generate(llm) == hf_tokens(path)
    llm.update_weights_from_disk(original)


def test_sleep_level_2_then_an_update_serves_the_new_weights(llm: LLM, changed: tuple, original: str) -> None:
    path, tensors = changed
    llm.sleep(level=2)
    with pytest.raises(ValueError, match="the weights are asleep"):
        llm.update_weights_from_tensors(tensors)
    llm.wake_up(tags=["weights"])
    llm.update_weights_from_tensors(tensors)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert generate(llm) == hf_tokens(path)
    llm.update_weights_from_disk(original)


def test_an_update_while_paused_in_keep_mode_shows_two_weight_versions(original: str, changed: tuple) -> None:
    """A request frozen by pause(mode="keep") continues after the resume on the new weights."""
    _, tensors = changed
    # Long enough that the request is still running when the pause arrives, on a loaded machine too.
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    args = EngineArgs(model=original, max_model_len=512, max_num_seqs=4)
    engine = AsyncLLM(args, multiprocess=False)

    async def run() -> tuple:
        stream = engine.generate({"prompt_token_ids": PROMPTS[0]}, params, "kept")
        first = await anext(stream)  # running: its first token is out
        await engine.pause_generation(mode="keep", clear_cache=False)
        await engine.update_weights_from_tensors(tensors, weight_version="step-1")
        await engine.resume_generation()
        outputs = [first] + [output async for output in stream]
        return [s for output in outputs for s in output.outputs[0].weight_versions]

    try:
        spans = asyncio.run(run())
    finally:
        engine.shutdown()
    versions = [span.version for span in spans]
    assert versions[0] == "0" and versions[-1] == "step-1" and set(versions) == {"0", "step-1"}
    assert versions.index("step-1") == len([v for v in versions if v == "0"])  # old, then new
    assert all(isinstance(span, WeightVersionSpan) for span in spans)
