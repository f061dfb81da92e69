"""Qwen3 (Yang et al., 2025, "Qwen3 Technical Report"): the Llama architecture with RMSNorm
applied to each query and key head before the rotary embedding (QK-norm, which the report uses
instead of Qwen2's QKV bias to stabilize training), and a head_dim set in the config rather than
derived from hidden_size."""

from __future__ import annotations

from typing import Any

import torch

from shoal.layers.layernorm import RMSNorm
from shoal.layers.quantization.fp8_config import Fp8Config
from shoal.layers.rotary import RotaryEmbedding
from shoal.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, config: Any, rotary_emb: RotaryEmbedding, quant_config: Fp8Config | None = None, prefix: str = ""
    ):
        super().__init__(config, rotary_emb, quant_config, prefix)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm over head_dim of every query and key head."""
        num_tokens = q.shape[0]
        q = self.q_norm(q.reshape(num_tokens, -1, self.head_dim))  # [num_tokens, num_heads, head_dim]
        k = self.k_norm(k.reshape(num_tokens, -1, self.head_dim))  # [num_tokens, num_kv_heads, head_dim]
        return q.reshape(num_tokens, -1), k.reshape(num_tokens, -1)  # [num_tokens, num_(kv_)heads * head_dim]

    def qk_norm_params(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
