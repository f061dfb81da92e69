"""Load a checkpoint with shoal and with transformers, and run shoal's model one step at a time
on a flat batch through a freshly allocated paged KV cache."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from shoal.config import EngineArgs, ParallelConfig
from shoal.forward_context import set_forward_context
from shoal.models.loader import get_model
from tests.kernels.metadata_utils import allocate_block_tables, make_attention_metadata


def load_shoal(
    path: Path, load_format: str = "auto", parallel_config: ParallelConfig | None = None, dtype: str = "float32"
):
    config = EngineArgs(model=str(path), dtype=dtype, device="cpu", load_format=load_format).create_engine_config()
    return get_model(config.model_config, torch.device("cpu"), parallel_config)


def hf_logits(path: Path, sequences: list[list[int]], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Hugging Face's logits [len, vocab] at every position of each sequence, run one by one."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        return [model(torch.tensor([seq])).logits[0] for seq in sequences]


class PagedRunner:
    """Runs the model step by step; each request keeps its blocks across steps."""

    def __init__(self, models, max_seq_lens: list[int], block_size: int = 4):
        self.models = models if isinstance(models, list) else [models]  # pipeline stages, in order
        self.block_size = block_size
        num_blocks = sum(-(-n // block_size) for n in max_seq_lens) + 2
        self.block_tables = allocate_block_tables(
            max_seq_lens, block_size, num_blocks, torch.Generator().manual_seed(1)
        )
        for model in self.models:
            for layer in model.attention_layers():
                dtype = next(model.parameters()).dtype
                layer.kv_cache = layer.kv_cache_spec.allocate(num_blocks, block_size, dtype, torch.device("cpu"))

    def step(self, sequences: list[list[int]], chunks: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Compute positions [start, end) of each sequence; returns each one's logits [end - start, vocab]."""
        input_ids = torch.tensor([t for seq, (s, e) in zip(sequences, chunks) for t in seq[s:e]])
        positions = torch.cat([torch.arange(s, e) for s, e in chunks])
        md = make_attention_metadata(
            [e - s for s, e in chunks], [e for _, e in chunks], self.block_tables, self.block_size
        )
        with set_forward_context(md), torch.inference_mode():
            hidden = None
            for model in self.models:
                hidden = model(input_ids, positions, hidden)
            logits = self.models[-1].compute_logits(hidden)
        return list(logits.split([e - s for s, e in chunks]))
