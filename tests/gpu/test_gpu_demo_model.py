"""The real demo model (SmolLM2-135M-Instruct) in bf16 on the GPU against transformers in bf16:
the first 16 greedy tokens agree on at least 90% of prompts."""

from __future__ import annotations

import pytest
import torch

from shoal import LLM, SamplingParams
from tests.test_correctness import TEXTS

pytestmark = pytest.mark.gpu

CHATS = [
    "What is the capital of France?",
    "Write a Python function that returns the sum of two numbers.",
    "Name three primary colors.",
    "Explain what a KV cache is in one sentence.",
    "Give me a haiku about the sea.",
    "What is 12 times 12?",
    "Translate 'good morning' into French.",
    "List two uses of a hammer.",
]


def test_demo_model_bf16_on_gpu_matches_transformers(demo_model_path: str) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(demo_model_path, device="cuda", dtype="bfloat16", multiprocess=False)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in TEXTS]
    prompts += [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for c in CHATS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    ours = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    hf = AutoModelForCausalLM.from_pretrained(demo_model_path, dtype=torch.bfloat16).cuda().eval()
    equal = 0
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, ours):
            out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False)
            equal += tokens == out[0, len(prompt) :].tolist()
    print(f"SmolLM2 bf16 on GPU: {equal}/{len(prompts)} prompts equal for 16 tokens")
    assert equal >= 0.9 * len(prompts)
