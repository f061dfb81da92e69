"""A trainer Ray actor syncs changed weights into a TP=2 and into a PP=2 engine over gloo, in
several buckets (`WeightSender` → `update_weights_from_distributed`); each engine's greedy output
then equals Hugging Face transformers on the changed weights and differs from before. The TP=2
engine also takes tensors (`update_weights_from_tensors`) and a folder
(`update_weights_from_disk`), each rank keeping its shard.

Every engine joins the session's Ray cluster (`ray_cluster`, 4 logical CPUs); the trainer
takes none of its CPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shoal import LLM, SamplingParams
from tests.hf_reference import hf_greedy
from tests.ray_nodes import free_ports
from tests.rl.rl_utils import Trainer, noised, save_checkpoint

NUM_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3], list(range(30, 44))]
ENGINE_ARGS: dict[str, Any] = dict(max_model_len=128, max_num_seqs=4, multiprocess=False)
BUCKET_BYTES = 128 << 10  # the tiny Llama's ~400 KB in 4 buckets


def generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def hf_tokens(path: str) -> list[list[int]]:
    return [hf_greedy(path, p, NUM_TOKENS, stop_at_eos=False).token_ids for p in PROMPTS]


def sync_from_trainer(llm: LLM, trainer: Any, num_workers: int, version: str) -> int:
    """The call order of docs/rl.md: each collective's two sides run at once, the trainer's in
    its actor and the engine's here. Returns the number of buckets sent."""
    import ray

    (port,), world_size = free_ports(1), 1 + num_workers
    joined = trainer.start_sender.remote(port, world_size, BUCKET_BYTES)
    llm.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=world_size)
    ray.get(joined)
    metadata = ray.get(trainer.metadata.remote())
    sent = trainer.send.remote()
    assert llm.update_weights_from_distributed(**metadata, weight_version=version) == version
    num_buckets = ray.get(sent)
    llm.destroy_weight_update_group()
    ray.get(trainer.close.remote())
    return num_buckets


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_trainer_syncs_an_engine_over_gloo(
    ray_cluster: dict, tiny_checkpoints: dict, tmp_path: Path, layout: str
) -> None:
    import ray

    original = str(tiny_checkpoints["llama"])
    parallel = {"tensor_parallel_size": 2} if layout == "tp2" else {"pipeline_parallel_size": 2}
    trainer = ray.remote(num_cpus=0)(Trainer).remote(original)
    llm = LLM(original, **parallel, **ENGINE_ARGS)
    try:
        before = generate(llm)
        ray.get(trainer.train_step.remote(seed=1))
        changed = ray.get(trainer.save.remote(str(tmp_path / "step-1")))
        expected = hf_tokens(changed)
        assert expected != before
        assert sync_from_trainer(llm, trainer, num_workers=2, version="step-1") >= 2
        assert llm.weight_version == "step-1"
        assert generate(llm) == expected
        if layout == "tp2":
            check_tensor_and_disk_updates(llm, original, before, tmp_path)
    finally:
        llm.shutdown()
        ray.kill(trainer)


def check_tensor_and_disk_updates(llm: LLM, original: str, before: list, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    tensors = noised(load_file(str(Path(original) / "model.safetensors")), seed=2)
    path = save_checkpoint(original, tmp_path / "step-2", tensors)
    llm.update_weights_from_tensors(tensors, bucket_bytes=BUCKET_BYTES)
    assert generate(llm) == hf_tokens(path)
    llm.update_weights_from_disk(original)
    assert generate(llm) == before
