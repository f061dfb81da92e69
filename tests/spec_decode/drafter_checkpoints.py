"""Tiny drafters in the published checkpoint layouts, for the EAGLE-3 and MTP proposers' tests.

- `make_eagle3_head(path, target)`: an EAGLE-3 head for a tiny Llama target (tests/checkpoints.py),
  laid out as the published EAGLE-3 Llama-3.1-8B-Instruct head: config.json with
  `LlamaForCausalLMEagle3`, `draft_vocab_size` and `target_hidden_size`, and model.safetensors
  with `fc.weight` [hidden, 3 * hidden], `midlayer.*` (q/k/v_proj reading 2 * hidden,
  `hidden_norm`), `norm.weight`, `lm_head.weight` over a draft vocabulary smaller than the
  target's, `d2t` and `t2d`; no `embed_tokens.weight` (the target's serves). The tiny target has 3
  layers, too few for the published (2, L // 2, L - 3) choice of features, so the config names
  layers 0, 1 and 2 (`eagle_config.eagle_aux_hidden_state_layer_ids`, as heads trained for other
  layers do).
- `make_eagle_head(path, target)`: an EAGLE head (one layer: `fc` over [embedding; final hidden
  state] with a bias, `layers.0.*` without an input norm, its own copy of the embedding; the LM
  head is the target's).
- `add_mtp_layer(src, dst)`: a copy of a tiny DeepSeek-V3 checkpoint with one next-token module
  after its decoder layers (`num_nextn_predict_layers: 1`, `model.layers.{L}.*`: `enorm`, `hnorm`,
  `eh_proj`, a decoder layer with MLA and experts, `shared_head.norm`, and the copies of the
  embedding and LM head the released checkpoint carries as `embed_tokens` and `shared_head.head`).

Weights are random with the tiny checkpoints' scale (std 0.2), norms around 1, so that every
tensor matters to the output.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

EAGLE3_AUX_LAYERS = (0, 1, 2)
STD = 0.2


def make_eagle3_head(path: str | Path, target: str | Path, seed: int = 0, draft_vocab_size: int = 128) -> Path:
    path, target = Path(path), Path(target)
    path.mkdir(parents=True, exist_ok=True)
    t = json.loads((target / "config.json").read_text())
    hidden, vocab = t["hidden_size"], t["vocab_size"]
    num_heads, num_kv_heads = t["num_attention_heads"], t["num_key_value_heads"]
    head_dim = hidden // num_heads
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "target_hidden_size": hidden,
        "intermediate_size": t["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,  # shorter than the target's, as the published head's 2048
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(EAGLE3_AUX_LAYERS)},
    }
    gen = torch.Generator().manual_seed(seed)
    draft_to_target = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_to_target] = True
    m = "midlayer."
    tensors = {
        "fc.weight": _random(gen, hidden, 3 * hidden),
        f"{m}input_layernorm.weight": _norm(gen, hidden),
        f"{m}hidden_norm.weight": _norm(gen, hidden),
        f"{m}post_attention_layernorm.weight": _norm(gen, hidden),
        f"{m}self_attn.q_proj.weight": _random(gen, num_heads * head_dim, 2 * hidden),
        f"{m}self_attn.k_proj.weight": _random(gen, num_kv_heads * head_dim, 2 * hidden),
        f"{m}self_attn.v_proj.weight": _random(gen, num_kv_heads * head_dim, 2 * hidden),
        f"{m}self_attn.o_proj.weight": _random(gen, hidden, num_heads * head_dim),
        f"{m}mlp.gate_proj.weight": _random(gen, t["intermediate_size"], hidden),
        f"{m}mlp.up_proj.weight": _random(gen, t["intermediate_size"], hidden),
        f"{m}mlp.down_proj.weight": _random(gen, hidden, t["intermediate_size"]),
        "norm.weight": _norm(gen, hidden),
        "lm_head.weight": _random(gen, draft_vocab_size, hidden),
        "d2t": draft_to_target - torch.arange(draft_vocab_size),
        "t2d": t2d,
    }
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def make_eagle_head(path: str | Path, target: str | Path, seed: int = 0) -> Path:
    """An EAGLE head of one layer for a tiny Llama target: fc with a bias, no input norm in its
    layer, its own copy of the target's embedding; the LM head is the target's."""
    path, target = Path(path), Path(target)
    path.mkdir(parents=True, exist_ok=True)
    t = json.loads((target / "config.json").read_text())
    hidden, num_heads, num_kv_heads = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"]
    head_dim, intermediate = hidden // num_heads, t["intermediate_size"]
    config = {
        **{key: t[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")},
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "vocab_size": t["vocab_size"],
        "torch_dtype": "float32",
    }
    gen = torch.Generator().manual_seed(seed)
    m = "layers.0."
    tensors = {
        "fc.weight": _random(gen, hidden, 2 * hidden),
        "fc.bias": _random(gen, hidden),
        f"{m}post_attention_layernorm.weight": _norm(gen, hidden),
        f"{m}self_attn.q_proj.weight": _random(gen, num_heads * head_dim, hidden),
        f"{m}self_attn.k_proj.weight": _random(gen, num_kv_heads * head_dim, hidden),
        f"{m}self_attn.v_proj.weight": _random(gen, num_kv_heads * head_dim, hidden),
        f"{m}self_attn.o_proj.weight": _random(gen, hidden, num_heads * head_dim),
        f"{m}mlp.gate_proj.weight": _random(gen, intermediate, hidden),
        f"{m}mlp.up_proj.weight": _random(gen, intermediate, hidden),
        f"{m}mlp.down_proj.weight": _random(gen, hidden, intermediate),
        "embed_tokens.weight": load_file(target / "model.safetensors")["model.embed_tokens.weight"],
    }
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def add_mtp_layer(src: str | Path, dst: str | Path, seed: int = 0) -> Path:
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    num_layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    # A decoder layer of the last one's kind (MLA, experts), with weights of its own.
    module = {mtp + n[len(last) :]: _like(gen, n, w) for n, w in sorted(tensors.items()) if n.startswith(last)}
    module.update(
        {
            f"{mtp}enorm.weight": _norm(gen, hidden),
            f"{mtp}hnorm.weight": _norm(gen, hidden),
            f"{mtp}eh_proj.weight": _random(gen, hidden, 2 * hidden),
            f"{mtp}shared_head.norm.weight": _norm(gen, hidden),
            f"{mtp}embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
            f"{mtp}shared_head.head.weight": tensors["lm_head.weight"].clone(),
        }
    )
    save_file({**tensors, **module}, dst / "model.safetensors")
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _random(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * STD


def _norm(gen: torch.Generator, size: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(size, generator=gen)


def _like(gen: torch.Generator, name: str, weight: torch.Tensor) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return _norm(gen, weight.shape[0])
    if name.endswith("e_score_correction_bias"):
        return torch.rand(weight.shape, generator=gen) * 0.5
    return _random(gen, *weight.shape)
