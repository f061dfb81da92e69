"""Random LoRA adapters in PEFT's layout for a model's shapes (benchmarks): every attention and
MLP projection of every decoder layer at one rank, written as adapter_config.json and
adapter_model.safetensors so that any engine that reads PEFT adapters (shoal, vLLM) loads the
same files. Written without peft (only the config is needed), in the model's dtype."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shoal.lora.peft_checkpoint import CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE


def projection_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """Projection → (in_features, out_features) of one decoder layer of a dense model."""
    hidden = int(hf_config.hidden_size)
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // num_heads)
    intermediate = int(hf_config.intermediate_size)
    return {
        "q_proj": (hidden, num_heads * head_dim),
        "k_proj": (hidden, num_kv_heads * head_dim),
        "v_proj": (hidden, num_kv_heads * head_dim),
        "o_proj": (num_heads * head_dim, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def write_random_adapter(
    hf_config: Any, folder: str | Path, rank: int = 16, seed: int = 0, dtype: str = "bfloat16", base_model: str = ""
) -> Path:
    """One adapter on every projection (A ~ U(-1/sqrt(in), 1/sqrt(in)), B ~ N(0, 1e-3))."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(hf_config.num_hidden_layers)):
        for module, (in_features, out_features) in projection_shapes(hf_config).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            bound = in_features**-0.5
            lora_a = (torch.rand(rank, in_features, generator=gen) * 2 - 1) * bound
            lora_b = torch.randn(out_features, rank, generator=gen) * 1e-3
            tensors[f"{name}.lora_A.weight"] = lora_a.to(getattr(torch, dtype))
            tensors[f"{name}.lora_B.weight"] = lora_b.to(getattr(torch, dtype))
    save_file(tensors, str(folder / WEIGHTS_FILE))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "use_rslora": False,
        "modules_to_save": None,
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return folder


def write_random_adapters(
    hf_config: Any, root: str | Path, num_adapters: int, rank: int = 16, dtype: str = "bfloat16", base_model: str = ""
) -> list[Path]:
    """`root/adapter_{i}` for i < num_adapters, each written once (an existing one is kept)."""
    folders = []
    for i in range(num_adapters):
        folder = Path(root) / f"adapter_{i}"
        if not (folder / WEIGHTS_FILE).is_file():
            write_random_adapter(hf_config, folder, rank, seed=i, dtype=dtype, base_model=base_model)
        folders.append(folder)
    return folders
