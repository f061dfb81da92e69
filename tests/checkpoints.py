"""Tiny random Hugging Face checkpoints (config.json, model.safetensors, tokenizer) for tests.

Each kind exercises one code path of the model files: GQA, Llama 3.1 rope scaling, QKV bias
with tied embeddings, QK-norm with an explicit head_dim, attention/MLP biases with a vocabulary
that no tensor-parallel size divides and a single KV head; and the mixture-of-experts families
(MOE_KINDS): Mixtral's routing, Qwen2-MoE's shared expert and dense layers, Qwen3-MoE's
renormalized routing saved with stacked expert tensors. Weights use a large init std so that
greedy generation is not degenerate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

KINDS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "llama_odd_vocab")
# Mixture-of-experts kinds, kept apart so that the tests looping over KINDS stay as long as they were.
MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")
# DeepSeek's multi-head latent attention with its mixtures of experts, kept apart likewise.
DEEPSEEK_KINDS = ("deepseek_v2", "deepseek_v3")

BOS, EOS = "<|bos|>", "<|eos|>"
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for shoal tests.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "one two three four five six seven eight nine ten",
    "Large language models generate text one token at a time.",
]
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|bos|>{{ message['role'] }}: {{ message['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}"
)

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    tie_word_embeddings=False,
)

_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(vocab_size=384)),
    "llama3": (
        "LlamaConfig",
        dict(
            vocab_size=384,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral": ("MistralConfig", dict(vocab_size=384, sliding_window=None)),
    "qwen2": (
        "Qwen2Config",
        dict(vocab_size=384, tie_word_embeddings=True, rope_parameters=dict(rope_theta=1e6)),
    ),
    "qwen3": ("Qwen3Config", dict(vocab_size=384, head_dim=32, rope_parameters=dict(rope_theta=1e6))),
    "llama_odd_vocab": (
        "LlamaConfig",
        dict(vocab_size=1001, num_key_value_heads=1, attention_bias=True, mlp_bias=True, num_hidden_layers=2),
    ),
    # 8 experts, top 2: softmax renormalized over the two.
    "mixtral": (
        "MixtralConfig",
        dict(vocab_size=384, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    ),
    # Unnormalized top 2 of 8, the gated shared expert, layer 1 dense (mlp_only_layers).
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            vocab_size=384,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            rope_parameters=dict(rope_theta=1e6),
        ),
    ),
    # Renormalized top 2 of 8, QK-norm; saved with the experts stacked (transformers 5's layout).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=384,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            rope_parameters=dict(rope_theta=1e6),
        ),
    ),
    # DeepSeek-V2(-Lite): MLA without q_lora, yarn rope with unequal mscales (cos and sin scaled),
    # group-limited greedy softmax routing (2 of 4 groups), 2 shared experts, layer 0 dense.
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(
            vocab_size=384,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            rope_scaling=dict(
                type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                mscale=0.707,
                mscale_all_dim=1.0,
                original_max_position_embeddings=128,
                beta_fast=32,
                beta_slow=1,
            ),
        ),
    ),
    # DeepSeek-V3: MLA with q_lora, sigmoid scores chosen with a (random, non-zero) correction
    # bias over 2 of 4 groups, renormalized and scaled; one shared expert; layer 0 dense.
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            vocab_size=384,
            num_key_value_heads=4,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_scaling=dict(
                type="yarn",
                rope_theta=10000.0,
                factor=8.0,
                mscale=1.0,
                mscale_all_dim=1.0,
                original_max_position_embeddings=64,
                beta_fast=32,
                beta_slow=1,
            ),
        ),
    ),
}
# Kinds saved as transformers holds them in memory (stacked expert tensors) rather than in the
# published per-tensor layout.
_SAVED_AS_IN_MEMORY = {"qwen3_moe"}


def make_tokenizer(path: Path, vocab_size: int, extra_tokens: tuple[str, ...] = ()) -> Any:
    """A byte-level BPE tokenizer trained on a few sentences, with bos/eos and a chat template,
    padded with filler tokens to exactly `vocab_size` so that every model id decodes;
    `extra_tokens` (markers such as "</think>") become single tokens before the fillers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=EOS, unk_token=EOS
    )
    fast.add_tokens(list(extra_tokens))
    fast.add_tokens([f"<|filler_{i}|>" for i in range(vocab_size - len(fast))])
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_checkpoint(kind: str, path: str | Path, seed: int = 0, extra_tokens: tuple[str, ...] = ()) -> Path:
    """Write a tiny float32 checkpoint of `kind` (one of KINDS) with its tokenizer into `path`
    (`extra_tokens`: see `make_tokenizer`)."""
    import transformers
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_name, overrides = _CONFIGS[kind]
    tokenizer = make_tokenizer(path, overrides["vocab_size"], extra_tokens)
    config = getattr(transformers, config_name)(
        **{**_COMMON, **overrides},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    assert config.vocab_size == len(tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_correction_biases(model)
    model.save_pretrained(path, safe_serialization=True, save_original_format=kind not in _SAVED_AS_IN_MEMORY)
    return path


def _randomize_correction_biases(model: Any) -> None:
    """DeepSeek-V3's routers start with an all-zero e_score_correction_bias, which would leave
    the bias's part of the routing untested: give it values of the scores' size."""
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.rand(buffer.shape) * 0.5)
