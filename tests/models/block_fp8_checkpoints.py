"""Block-wise fp8 checkpoints written from the tiny float checkpoints, and the Hugging Face
reference they are compared against.

`write_block_fp8_checkpoint` quantizes every linear weight of the decoder (attention, dense and
shared-expert MLPs, routed experts per expert or stacked) to e4m3 in blocks, with its
`weight_scale_inv`, under DeepSeek-V3's `quantization_config`; beside it, in `<dst>-dequantized`,
the same model with those weights dequantized to float32: what the fp8 model computes with.

`hf_block_fp8_model` loads the dequantized copy in transformers with every quantized linear
layer's input rounded per token and group of block_k as shoal's fp8 activations are (forward
pre-hooks on nn.Linear; the routed experts, which transformers keeps as stacked parameters
multiplied with F.linear in its "eager" experts implementation, get F.linear itself patched
around their forward). So it computes the
W8A8 model exactly, up to float32 summation order.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from shoal.kernels.fused_moe_block_fp8 import fake_quant_per_token_group
from shoal.kernels.w8a8_block_fp8_matmul import dequantize_block_fp8, quantize_block_fp8

LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
LINEAR_LAYERS += ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # DeepSeek's MLA
STACKED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def dequantized_path(path: Path) -> Path:
    return path.with_name(path.name + "-dequantized")


def _is_quantized(name: str) -> bool:
    if name.endswith(STACKED_EXPERTS):
        return True
    layer, _, leaf = name.rpartition(".")
    return leaf == "weight" and layer.rpartition(".")[2] in LINEAR_LAYERS


def write_block_fp8_checkpoint(src: Path, dst: Path, block_size: tuple[int, int]) -> Path:
    quantized, dequantized = {}, {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if not _is_quantized(name):
            quantized[name] = dequantized[name] = tensor
            continue
        w_fp8, scale_inv = quantize_block_fp8(tensor, block_size)
        scale_name = f"{name}_scale_inv" if name.endswith(".weight") else f"{name}.weight_scale_inv"
        quantized[name], quantized[scale_name] = w_fp8, scale_inv
        dequantized[name] = dequantize_block_fp8(w_fp8, scale_inv, block_size)
    for folder, weights in ((dst, quantized), (dequantized_path(dst), dequantized)):
        shutil.copytree(src, folder, dirs_exist_ok=True)
        save_file(weights, folder / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block_size),
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@contextmanager
def _fake_quant_linear(group_size: int):
    linear = F.linear

    def quantized_linear(x, weight, bias=None):
        return linear(fake_quant_per_token_group(x, group_size).to(x.dtype), weight, bias)

    torch.nn.functional.linear = quantized_linear
    try:
        yield
    finally:
        torch.nn.functional.linear = linear


def hf_block_fp8_model(path: Path, block_size: tuple[int, int], **config_overrides) -> torch.nn.Module:
    """transformers on `path`'s dequantized copy with fp8-rounded activations (module docstring);
    `config_overrides` change the config as it loads (e.g. one more layer, to build a DeepSeek
    next-token module's decoder layer)."""
    model = AutoModelForCausalLM.from_pretrained(
        dequantized_path(path), dtype=torch.float32, attn_implementation="eager", **config_overrides
    )
    group_size = block_size[1]

    def round_input(module, args):
        return (fake_quant_per_token_group(args[0], group_size).to(args[0].dtype), *args[1:])

    for name, module in model.named_modules():
        if name.rpartition(".")[2] in LINEAR_LAYERS and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(round_input)
        elif name.endswith(".experts") and hasattr(module, "gate_up_proj"):
            module.config._experts_implementation = "eager"  # the loop over experts with F.linear
            original = module.forward

            def forward(*args, _original=original, **kwargs):
                with _fake_quant_linear(group_size):
                    return _original(*args, **kwargs)

            module.forward = forward
    return model.eval()
