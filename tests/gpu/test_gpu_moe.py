"""Mixture-of-experts models on the GPU (the Triton fused-MoE kernels, CUDA graphs): exactly
transformers' tokens in float32 on the tiny checkpoints; bf16 as close to a float32 reference as transformers' own bf16 on a larger random
Qwen3-MoE; and no kernel compiled after start-up, whatever the batches."""

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


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_tiny_moe_models_on_gpu_match_hf_float32(moe_checkpoints: dict, kind: str) -> None:
    path = str(moe_checkpoints[kind])
    llm = gpu_llm(path, dtype="float32", max_num_batched_tokens=24, max_num_seqs=16)
    prompts = [llm.get_tokenizer().encode(t) for t in TEXTS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_32, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(path, prompt, 32, stop_at_eos=False).token_ids
    assert llm.engine_core.core.executor.worker.model_runner.cuda_graphs is not None


def _compiled_variants() -> int:
    """Compiled variants of the fused-MoE GEMM kernels (gate_up, down) in this process, over every device."""
    from shoal.kernels.triton.fused_moe import _moe_gate_up_silu_kernel, _moe_gemm_kernel

    kernels = (_moe_gate_up_silu_kernel, _moe_gemm_kernel)
    return sum(len(caches[0]) for kernel in kernels for caches in kernel.device_caches.values())


def test_nothing_compiles_after_start_up(moe_checkpoints: dict) -> None:
    """Batches of every size (decode graphs, eager decodes past them, prefills of 1 to 1,800
    tokens; the tiny checkpoint's context is 512) launch only kernels the warm-up compiled."""
    llm = gpu_llm(str(moe_checkpoints["qwen3_moe"]), dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048)
    compiled = _compiled_variants()
    assert compiled >= 2  # gate_up and down, at least one launch each
    generator = torch.Generator().manual_seed(0)
    for num_prompts, length in [(1, 5), (3, 300), (64, 20), (4, 450), (40, 2)]:
        prompts = [torch.randint(5, 380, (length + i,), generator=generator).tolist() for i in range(num_prompts)]
        llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_32, use_tqdm=False)
    assert _compiled_variants() == compiled


def test_bf16_random_qwen3_moe_is_as_close_to_float32_as_transformers(tmp_path_factory) -> None:
    """A random Qwen3-MoE of 8 layers (64 experts, top 8, hidden 1024) saved in bf16: taking
    transformers in float32 as the truth, shoal in bf16 matches it on at least as many prompts as
    transformers in bf16 does (one of slack; random weights make bf16 greedy decoding chaotic, see
    test_gpu_models.py), and shoal in float32 on all of them."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    path = tmp_path_factory.mktemp("qwen3-moe-small")
    config = Qwen3MoeConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        initializer_range=0.05,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 31000, (8 + 5 * i,), generator=generator).tolist() for i in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def shoal_tokens(dtype: str) -> list[list[int]]:
        llm = gpu_llm(str(path), dtype=dtype, max_model_len=512)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        del llm
        torch.cuda.empty_cache()
        return [o.outputs[0].token_ids for o in outputs]

    def hf_tokens(dtype: torch.dtype) -> list[list[int]]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
        with torch.inference_mode():
            tokens = [
                model.generate(
                    torch.tensor([p], device="cuda"),
                    max_new_tokens=16,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )[0, len(p) :].tolist()
                for p in prompts
            ]
        del model
        torch.cuda.empty_cache()
        return tokens

    truth = hf_tokens(torch.float32)
    agree = {
        name: sum(a == b for a, b in zip(tokens, truth))
        for name, tokens in [
            ("shoal_bf16", shoal_tokens("bfloat16")),
            ("hf_bf16", hf_tokens(torch.bfloat16)),
            ("shoal_fp32", shoal_tokens("float32")),
        ]
    }
    print(f"random Qwen3-MoE, prompts equal to transformers float32 for 16 tokens (of {len(prompts)}): {agree}")
    assert agree["shoal_fp32"] == len(prompts)
    assert agree["shoal_bf16"] >= agree["hf_bf16"] - 1
