"""A stand-in trainer for the weight-update tests: it holds a tiny checkpoint's tensors, changes
them as a training step would (adds noise), saves them as a checkpoint folder (for the Hugging
Face reference and disk updates) and sends them through a `WeightSender`."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from shoal.rl import WeightSender

WEIGHTS_FILE = "model.safetensors"


def save_checkpoint(source: str | Path, target: str | Path, weights: dict[str, torch.Tensor]) -> str:
    """A copy of the checkpoint folder `source` (config, tokenizer) with `weights` as its tensors."""
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != "model.safetensors.index.json":
            shutil.copy(file, target / file.name)
    save_file({n: t.contiguous() for n, t in weights.items()}, str(target / WEIGHTS_FILE))
    return str(target)


def noised(weights: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Every tensor plus scale * N(0, 1) noise: a "training step" that changes greedy outputs."""
    generator = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=generator, dtype=t.dtype) for n, t in weights.items()}


class Trainer:
    """Run as a Ray actor (`ray.remote(num_cpus=0)(Trainer)`), or in-process."""

    def __init__(self, checkpoint: str) -> None:
        self.checkpoint = checkpoint
        self.weights = load_file(str(Path(checkpoint) / WEIGHTS_FILE))
        self.sender: WeightSender | None = None

    def train_step(self, seed: int) -> None:
        self.weights = noised(self.weights, seed)

    def save(self, folder: str) -> str:
        return save_checkpoint(self.checkpoint, folder, self.weights)

    def start_sender(self, master_port: int, world_size: int, bucket_bytes: int) -> None:
        self.sender = WeightSender("127.0.0.1", master_port, world_size, backend="gloo", bucket_bytes=bucket_bytes)

    def metadata(self) -> dict[str, Any]:
        assert self.sender is not None
        return self.sender.metadata(self.weights)

    def send(self) -> int:
        assert self.sender is not None
        return self.sender.send(self.weights)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
