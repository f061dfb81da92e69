"""shoal on the GPU against transformers on the same weights: exactly in float32 on the tiny
checkpoints, and in bf16 on a 1B-shaped random checkpoint; CUDA graphs on and off agree; the
KV cache is sized by profiling."""

from __future__ import annotations

import pytest
import torch

from shoal import LLM, SamplingParams
from tests.hf_reference import hf_greedy
from tests.test_correctness import TEXTS

pytestmark = pytest.mark.gpu

GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def gpu_llm(path: str, **kwargs) -> LLM:
    return LLM(path, device="cuda", multiprocess=False, **kwargs)


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3"])
def test_tiny_models_on_gpu_match_hf_float32(tiny_checkpoints: dict, kind: str) -> None:
    path = str(tiny_checkpoints[kind])
    llm = gpu_llm(path, dtype="float32", max_num_batched_tokens=24, max_num_seqs=16)
    prompts = [llm.get_tokenizer().encode(t) for t in TEXTS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_32, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(path, prompt, 32, stop_at_eos=False).token_ids
    assert llm.engine_core.core.executor.worker.model_runner.cuda_graphs is not None
    assert llm.get_stats()["num_kv_blocks"] > 100  # sized by profiling, not an override


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_on_and_off_give_identical_tokens(tiny_checkpoints: dict, dtype: str) -> None:
    path = str(tiny_checkpoints["qwen3"])
    prompts = [{"prompt_token_ids": list(range(5 + i, 20 + 3 * i))} for i in range(24)]
    tokens = []
    for eager in (True, False):
        llm = gpu_llm(path, dtype=dtype, enforce_eager=eager, max_num_seqs=32)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY_32, use_tqdm=False)])
        del llm
        torch.cuda.empty_cache()
    assert tokens[0] == tokens[1]


def test_1b_shaped_checkpoint_bf16_is_as_close_to_float32_as_transformers(tmp_path_factory) -> None:
    """Llama-3.2-1B shapes with random weights (saved once as bf16 safetensors).

    Random weights make greedy decoding in bf16 chaotic: transformers' own SDPA and eager
    attention agree on the first 16 tokens of only ~30% of prompts (seen on a 4-layer proxy on
    CPU). So the bar is relative: taking transformers in float32 as the truth, shoal in bf16
    matches it on at least as many prompts as transformers in bf16 does (one prompt of slack),
    and shoal in float32 matches it on all of them."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("llama-1b")
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        initializer_range=0.05,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 31000, (8 + 5 * i,), generator=generator).tolist() for i in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def shoal_tokens(dtype: str) -> list[list[int]]:
        llm = gpu_llm(str(path), dtype=dtype, max_model_len=512)
        tokens = [
            o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ]
        del llm
        torch.cuda.empty_cache()
        return tokens

    def hf_tokens(dtype: torch.dtype) -> list[list[int]]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
        with torch.inference_mode():
            return [
                model.generate(
                    torch.tensor([p], device="cuda"),
                    max_new_tokens=16,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )[0, len(p) :].tolist()
                for p in prompts
            ]

    truth = hf_tokens(torch.float32)
    agree = {
        name: sum(a == b for a, b in zip(tokens, truth))
        for name, tokens in [
            ("shoal_bf16", shoal_tokens("bfloat16")),
            ("hf_bf16", hf_tokens(torch.bfloat16)),
            ("shoal_fp32", shoal_tokens("float32")),
        ]
    }
    print(f"1B random, prompts equal to transformers float32 for 16 tokens (of {len(prompts)}): {agree}")
    assert agree["shoal_fp32"] == len(prompts)
    assert agree["shoal_bf16"] >= agree["hf_bf16"] - 1
