"""RL weight sync: a trainer Ray actor and a rollout engine with tensor parallelism 2.

Each "training step" changes the trainer's weights (a little noise stands in for an optimizer
step); the trainer then broadcasts them to both engine workers in buckets, over gloo on a CPU
(NCCL on GPUs), and the engine generates with them. Runs on a CPU machine.

python examples/rlhf.py [MODEL_DIR]        # default: the demo model
"""

import os
import socket
import sys

import ray
import torch

from shoal import LLM, SamplingParams
from shoal.rl import WeightSender

PROMPTS = ["The capital of France is", "The three primary colors are"]
NUM_STEPS = 3
BUCKET_BYTES = 16 << 20  # small buckets, so that the demo model takes several


@ray.remote(num_cpus=0)  # the CPUs (or GPUs) are the engine workers'
class Trainer:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.sender: WeightSender | None = None

    def join(self, master_port: int, world_size: int) -> None:
        """Rank 0 of the weight-update group; returns once the engine's workers have joined."""
        self.sender = WeightSender("127.0.0.1", master_port, world_size, bucket_bytes=BUCKET_BYTES)

    def train_step(self, step: int) -> None:
        generator = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(0.005 * torch.randn(param.shape, generator=generator))

    def metadata(self) -> dict:
        assert self.sender is not None
        return self.sender.metadata(self.model)

    def send(self) -> int:
        assert self.sender is not None
        return self.sender.send(self.model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    from shoal.demo_model import ensure_demo_model

    model = sys.argv[1] if len(sys.argv) > 1 else ensure_demo_model()
    ray.init(num_cpus=None if os.environ.get("RAY_ADDRESS") else 4)  # a running cluster, or a local one
    trainer = Trainer.remote(model)
    # multiprocess=False: the engine core runs in this process, already connected to Ray.
    llm = LLM(model, tensor_parallel_size=2, max_model_len=256, multiprocess=False)
    params = SamplingParams(temperature=0.0, max_tokens=12)

    # The group: the trainer's rank 0 and the engine's two workers (ranks 1 and 2). Both sides
    # block until the other has joined, so the trainer's call runs in its actor meanwhile.
    port, world_size = free_port(), 1 + 2
    joined = trainer.join.remote(port, world_size)
    llm.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=world_size)
    ray.get(joined)

    for step in range(1, NUM_STEPS + 1):
        ray.get(trainer.train_step.remote(step))
        metadata = ray.get(trainer.metadata.remote())
        sent = trainer.send.remote()  # the broadcast starts; the engine receives it meanwhile
        version = llm.update_weights_from_distributed(**metadata, weight_version=f"step-{step}")
        num_buckets = ray.get(sent)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        print(f"weights {version} ({num_buckets} buckets): {outputs[0].outputs[0].text!r}")

    llm.destroy_weight_update_group()
    llm.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
