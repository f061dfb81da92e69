"""The KV-cache spec a layer declares sizes and shapes its cache."""

from __future__ import annotations

import torch

from shoal.layers.attention import Attention
from shoal.layers.kv_cache_spec import full_attention_spec, mla_spec


def test_standard_attention_keeps_a_key_and_a_value_per_kv_head():
    spec = Attention(num_heads=8, head_dim=64, scale=0.125, num_kv_heads=2).kv_cache_spec
    assert spec == full_attention_spec(2, 64)
    assert spec.shape(10, 16) == (2, 10, 16, 2, 64)
    assert spec.block_bytes(16, torch.bfloat16) == 2 * 16 * 2 * 64 * 2


def test_mla_keeps_one_latent_per_token_for_all_heads():
    spec = mla_spec(kv_lora_rank=512, qk_rope_head_dim=64)  # DeepSeek-V3: 576 values, whatever the heads
    assert spec.shape(10, 16) == (1, 10, 16, 1, 576)
    assert spec.block_bytes(16, torch.bfloat16) == 16 * 576 * 2
    cache = spec.allocate(3, 4, torch.float32, torch.device("cpu"))
    assert cache.shape == (1, 3, 4, 1, 576) and not cache.any()
