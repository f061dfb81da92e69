"""Which slice of each Hugging Face tensor a tensor-parallel rank loads (fake 2-rank group: the
shapes and shards are checked, no collectives run)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.layers.tp_utils import fake_tp_group
from tests.models.model_utils import load_shoal


def _half(t: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(2, dim=dim)[rank]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", ["llama_odd_vocab", "qwen2", "qwen3"])
def test_tp2_shards(tiny_checkpoints, kind, rank):
    path = tiny_checkpoints[kind]
    hf = load_file(path / "model.safetensors")
    with fake_tp_group(rank):
        model = load_shoal(path)
    config = model.config
    head_dim = model.model.layers["0"].self_attn.head_dim
    attn = model.model.layers["0"].self_attn
    p = "model.layers.0."

    # Query heads split in two; KV heads split, or replicated when there is only one.
    kv_rows = head_dim * max(1, config.num_key_value_heads // 2)
    kv_head = rank * config.num_key_value_heads // 2
    kv = slice(kv_head * head_dim, kv_head * head_dim + kv_rows)
    for suffix in ("weight", "bias"):
        if f"{p}self_attn.q_proj.{suffix}" not in hf:
            continue
        q, k, v = (hf[f"{p}self_attn.{n}_proj.{suffix}"] for n in "qkv")
        expected = torch.cat((_half(q, rank), k[kv], v[kv]))
        assert torch.equal(getattr(attn.qkv_proj, suffix), expected)
    assert attn.attn.num_heads == config.num_attention_heads // 2
    assert attn.attn.num_kv_heads == max(1, config.num_key_value_heads // 2)

    assert torch.equal(attn.o_proj.weight, _half(hf[f"{p}self_attn.o_proj.weight"], rank, dim=1))
    mlp = model.model.layers["0"].mlp
    gate, up = hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat((_half(gate, rank), _half(up, rank))))
    assert torch.equal(mlp.down_proj.weight, _half(hf[f"{p}mlp.down_proj.weight"], rank, dim=1))
    if f"{p}mlp.down_proj.bias" in hf:  # row-parallel bias: whole on every rank, added by rank 0
        assert torch.equal(mlp.down_proj.bias, hf[f"{p}mlp.down_proj.bias"])
    if kind == "qwen3":
        assert torch.equal(attn.q_norm.weight, hf[f"{p}self_attn.q_norm.weight"])

    # Vocabulary padded to a multiple of 128 and split in two; padding rows are zero.
    embedding = model.model.embed_tokens
    per_rank = embedding.num_embeddings_per_partition
    assert embedding.num_embeddings_padded == -(-config.vocab_size // 128) * 128 == 2 * per_rank
    rows = hf["model.embed_tokens.weight"][rank * per_rank : (rank + 1) * per_rank]
    assert torch.equal(embedding.weight[: len(rows)], rows)
    assert torch.count_nonzero(embedding.weight[len(rows) :]) == 0
    if config.tie_word_embeddings:
        assert model.lm_head.weight is embedding.weight
    else:
        head_rows = hf["lm_head.weight"][rank * per_rank : (rank + 1) * per_rank]
        assert torch.equal(model.lm_head.weight[: len(head_rows)], head_rows)
