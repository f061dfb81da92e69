"""Greedy shoal on the GPU equals transformers on the same weights (the tiny checkpoints, float32)."""

from __future__ import annotations

import pytest
import torch

from shoal import LLM, SamplingParams
from tests.hf_reference import hf_greedy
from tests.test_correctness import TEXTS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3"])
def test_tiny_models_on_gpu_match_hf_float32(tiny_checkpoints: dict, kind: str) -> None:
    path = str(tiny_checkpoints[kind])
    llm = LLM(
        path,
        device="cuda",
        dtype="float32",
        multiprocess=False,
        num_gpu_blocks_override=512,
        max_num_batched_tokens=24,
        block_size=16,
    )
    prompts = [llm.get_tokenizer().encode(t) for t in TEXTS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(path, prompt, 32, stop_at_eos=False).token_ids
    assert torch.cuda.is_available()
