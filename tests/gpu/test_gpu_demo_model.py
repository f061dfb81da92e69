"""The real demo model (SmolLM2-135M-Instruct) on the GPU against transformers on the same
weights, 64 prompts (plain text and chat), the first 16 greedy tokens (up to EOS).

float32: shoal equals transformers on every prompt. bfloat16: rounding alone makes greedy
decoding of this model diverge within 16 tokens on about a third of the prompts, whoever
computes it: transformers' own SDPA and eager attention agree with each other on 41 of 64, and
with transformers float32 on 45 and 44 (shoal: 42; H200, 2026-12-01). Which prompts diverge
shifts with any change of summation order, so such counts spread by about ±4 (one standard
deviation) between correct bf16 implementations. The bf16 bar is therefore relative: taking
transformers float32 as the truth, shoal bf16 must match it on as many prompts as the worse of
transformers' two bf16 implementations, less 10% of the prompts. A real bf16 bug (a wrong rope,
rounding or mask) diverges on most prompts and fails it; float32 must match exactly."""

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
TOPICS = ["the moon", "bread", "rivers", "chess", "python lists", "volcanoes", "the piano", "tea", "bicycles", "rain"]
TOPICS += ["cats", "the ocean", "paper", "gravity", "music", "trees", "salt", "trains", "clouds", "honey", "maps"]
TOPICS += ["glass", "coffee", "snow"]
GREEDY_16 = SamplingParams(temperature=0.0, max_tokens=16)


def demo_prompts(tokenizer) -> list[list[int]]:
    def chat(text: str) -> list[int]:
        message = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]

    prompts = [tokenizer.encode(t) for t in TEXTS] + [chat(c) for c in CHATS]
    return prompts + [chat(f"{q} {t}.") for t in TOPICS for q in ("Tell me one fact about", "Write one sentence about")]


def shoal_tokens(path: str, prompts: list[list[int]], dtype: str) -> list[list[int]]:
    llm = LLM(path, device="cuda", dtype=dtype, multiprocess=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_16, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outputs]


def hf_tokens(path: str, prompts: list[list[int]], dtype: torch.dtype, attention: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attention).cuda().eval()
    with torch.inference_mode():
        return [
            model.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]


def test_demo_model_on_gpu_matches_transformers(demo_model_path: str) -> None:
    from transformers import AutoTokenizer

    prompts = demo_prompts(AutoTokenizer.from_pretrained(demo_model_path))
    assert len(prompts) == 64
    truth = hf_tokens(demo_model_path, prompts, torch.float32, "sdpa")
    runs = {
        "shoal_fp32": shoal_tokens(demo_model_path, prompts, "float32"),
        "shoal_bf16": shoal_tokens(demo_model_path, prompts, "bfloat16"),
        "hf_bf16_sdpa": hf_tokens(demo_model_path, prompts, torch.bfloat16, "sdpa"),
        "hf_bf16_eager": hf_tokens(demo_model_path, prompts, torch.bfloat16, "eager"),
    }
    agree = {name: sum(a == b for a, b in zip(tokens, truth)) for name, tokens in runs.items()}
    print(f"SmolLM2 on GPU, prompts equal to transformers float32 for 16 tokens (of {len(prompts)}): {agree}")
    assert agree["shoal_fp32"] == len(prompts)
    assert agree["shoal_bf16"] >= min(agree["hf_bf16_sdpa"], agree["hf_bf16_eager"]) - len(prompts) // 10
