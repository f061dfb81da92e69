"""Tiny random PEFT adapters for the LoRA tests, and the transformers + peft reference.

`make_adapter` builds the adapter with peft on the base checkpoint (random A and B, scaled up so
that the adapter really changes the greedy tokens) and saves it in PEFT's layout; `peft_greedy`
runs transformers with it."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# transformers 5's stacked MoE experts (Qwen3-MoE, Mixtral), targeted as parameters.
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def make_adapter(
    base: str | Path,
    out: str | Path,
    r: int = 8,
    lora_alpha: int = 16,
    use_rslora: bool = False,
    target_modules: list[str] | None = None,
    seed: int = 0,
    scale: float = 4.0,
    target_parameters: list[str] | None = None,
) -> Path:
    """`target_parameters` adds LoRA on stacked parameters (the MoE experts'); with it an empty
    `target_modules` adapts those alone."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(Path(base), dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        use_rslora=use_rslora,
        target_modules=(target_modules or ALL_PROJECTIONS) if target_modules != [] else None,
        target_parameters=target_parameters,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    peft_model.save_pretrained(str(out))
    return Path(out)


@cache
def _peft_model(base: str, adapter: str) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(base), dtype=torch.float32, attn_implementation="eager")
    return PeftModel.from_pretrained(model, adapter).eval()


@torch.inference_mode()
def peft_greedy(base: str | Path, adapter: str | Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = _peft_model(str(base), str(adapter))
    out = model.generate(
        input_ids=torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()
