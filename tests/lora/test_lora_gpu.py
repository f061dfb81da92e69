"""LoRA on a GPU (run on the GPU machine: python -m pytest -m gpu tests/lora): decode steps replay
CUDA graphs with adapters active (the Triton segment kernels reading the slots and segments
from their static buffers), prefill chunks take the grouped GEMMs; greedy output equals transformers + peft
in float32, and a mixed batch equals each request alone and the eager engine."""

from __future__ import annotations

import pytest

from shoal import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import make_adapter, peft_greedy

PROMPTS = [[5, 17, 42, 99, 7], [3, 1, 4, 1, 5, 9, 2, 6], [11, 12], [200, 201, 202, 203]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.gpu
def test_cuda_graphs_with_adapters_equal_peft_and_eager(tiny_checkpoints: dict, tmp_path) -> None:
    base = tiny_checkpoints["llama"]
    adapters = [make_adapter(base, tmp_path / f"a{i}", r=8 * (i + 1), seed=50 + i) for i in range(3)]
    loras = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(adapters)] + [None]
    cases = [(p, lora) for p in PROMPTS for lora in loras]
    results = {}
    for eager in (False, True):
        with LLM(
            str(base), dtype="float32", device="cuda", enforce_eager=eager, enable_lora=True, max_loras=2,
            max_lora_rank=32, max_num_seqs=8, gpu_memory_utilization=0.3, multiprocess=False,
        ) as llm:  # fmt: skip
            outputs = llm.generate([{"prompt_token_ids": p} for p, _ in cases], GREEDY, use_tqdm=False,
                                   lora_request=[lora for _, lora in cases])  # fmt: skip
            results[eager] = [o.outputs[0].token_ids for o in outputs]
    assert results[False] == results[True]
    for (prompt, lora), tokens in zip(cases, results[False]):
        if lora is not None:
            assert tokens == peft_greedy(base, lora.lora_path, prompt, 12)
