"""Qwen2 and Qwen2.5 (Yang et al., 2024, "Qwen2 Technical Report"; Qwen Team, 2024, "Qwen2.5
Technical Report"): the Llama architecture with a bias on the query, key and value projections
(none on the output projection), and optionally tied input/output embeddings."""

from __future__ import annotations

from typing import Any

from shoal.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def biases(config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
