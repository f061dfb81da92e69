"""Weight updates on a GPU: CUDA tensors of this process reach an engine whose core runs in
another process through CUDA IPC, bucket by bucket (and an in-process engine through the same
buckets without IPC); a folder loads on the GPU; the greedy output is then transformers' on the
new weights, and the old one after the original weights come back. A trainer on one GPU and an
engine on another sync over NCCL (two GPUs; the multi-GPU run measures it).

Figures for an 8B-shaped model come from tests/gpu/rl_ipc_bench.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shoal import LLM, SamplingParams
from tests.hf_reference import hf_greedy
from tests.ray_nodes import free_ports
from tests.rl.rl_utils import WEIGHTS_FILE, noised, save_checkpoint

pytestmark = pytest.mark.gpu

NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3], list(range(30, 52))]
ENGINE_ARGS = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.2, max_num_seqs=8, max_model_len=256)


def generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def hf_tokens(path: str) -> list[list[int]]:
    return [hf_greedy(path, p, NUM_TOKENS, stop_at_eos=False).token_ids for p in PROMPTS]


@pytest.mark.parametrize("multiprocess", [True, False], ids=["cuda-ipc", "in-process"])
def test_cuda_tensors_update_the_engine(tiny_checkpoints: dict, tmp_path: Path, multiprocess: bool) -> None:
    original = str(tiny_checkpoints["llama"])
    changed = noised(load_file(str(Path(original) / WEIGHTS_FILE)), seed=1)
    path = save_checkpoint(original, tmp_path / "changed", changed)
    cuda_tensors = {name: t.cuda() for name, t in changed.items()}
    with LLM(original, multiprocess=multiprocess, **ENGINE_ARGS) as llm:
        before = generate(llm)
        assert llm.update_weights_from_tensors(cuda_tensors, weight_version="ipc", bucket_bytes=128 << 10) == "ipc"
        assert generate(llm) == hf_tokens(path)
        # The caller's tensors are still its own: changing them changes nothing in the engine.
        next(iter(cuda_tensors.values())).zero_()
        assert generate(llm) == hf_tokens(path)
        with pytest.raises(ValueError, match="has dtype bfloat16"):
            llm.update_weights_from_tensors({"model.norm.weight": torch.ones(64, dtype=torch.bfloat16, device="cuda")})
        llm.update_weights_from_disk(original)
        assert generate(llm) == before


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between a trainer and an engine needs two GPUs")
def test_nccl_sync_from_a_trainer_on_another_gpu(tiny_checkpoints: dict, tmp_path: Path) -> None:
    import threading

    from shoal.rl import WeightSender

    original = str(tiny_checkpoints["llama"])
    changed = noised(load_file(str(Path(original) / WEIGHTS_FILE)), seed=3)
    path = save_checkpoint(original, tmp_path / "changed", changed)
    (port,) = free_ports(1)
    senders: list[WeightSender] = []
    trainer = threading.Thread(target=lambda: senders.append(WeightSender("127.0.0.1", port, 2, device="cuda:1")))
    with LLM(original, **ENGINE_ARGS) as llm:  # its core process works on GPU 0
        trainer.start()
        llm.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=2)
        trainer.join()
        sender = senders[0]
        weights = {n: t.to("cuda:1") for n, t in changed.items()}
        sending = threading.Thread(target=sender.send, args=(weights,))
        sending.start()
        llm.update_weights_from_distributed(**sender.metadata(weights))
        sending.join()
        assert generate(llm) == hf_tokens(path)
        llm.destroy_weight_update_group()
        sender.close()
