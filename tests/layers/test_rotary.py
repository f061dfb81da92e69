from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from shoal.layers.rotary import get_rope, rope_params_from_config, yarn_softmax_scale

LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def test_rope_params_from_transformers_v5_config():
    config = LlamaConfig(
        max_position_embeddings=512,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, **LLAMA3_SCALING),
    )
    params = rope_params_from_config(config)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500000.0 and params["factor"] == 8.0


def test_rope_params_from_old_style_config():
    old = SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_params_from_config(old) == {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}
    plain = SimpleNamespace(rope_theta=5e5, rope_scaling=None)
    assert rope_params_from_config(plain) == {"rope_theta": 5e5, "rope_type": "default"}
    assert rope_params_from_config(SimpleNamespace())["rope_theta"] == 10000.0


def test_unsupported_rope_type_fails_clearly():
    with pytest.raises(NotImplementedError, match="longrope"):
        get_rope(16, 64, {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0})


@pytest.mark.parametrize(
    "rope_parameters",
    [
        dict(rope_type="default", rope_theta=10000.0),
        dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
        dict(rope_type="llama3", rope_theta=500000.0, **LLAMA3_SCALING),
    ],
)
def test_cos_sin_cache_matches_hf(rope_parameters):
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=2, max_position_embeddings=512, rope_parameters=rope_parameters
    )
    hf = LlamaRotaryEmbedding(config)
    positions = torch.arange(512)
    x = torch.zeros(1, 512, 32)
    cos, sin = hf(x, positions[None])
    rope = get_rope(32, 512, rope_params_from_config(config))
    expected = torch.cat((cos[0, :, :16], sin[0, :, :16]), dim=-1)
    torch.testing.assert_close(rope.cos_sin_cache, expected, rtol=0, atol=1e-6)


def test_llama3_scaling_changes_low_frequencies_only():
    base = get_rope(32, 512, {"rope_type": "default", "rope_theta": 500000.0})
    scaled = get_rope(32, 512, {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING})

    def angles(rope):
        return torch.atan2(rope.cos_sin_cache[:, 16:], rope.cos_sin_cache[:, :16])  # [512, 16]

    assert torch.equal(angles(base)[:, 0], angles(scaled)[:, 0])  # highest frequency: untouched
    torch.testing.assert_close(angles(scaled)[1:, -1] * 8, angles(base)[1:, -1], rtol=1e-4, atol=0)  # lowest: / factor


def test_rotary_module_rotates_in_place():
    rope = get_rope(8, 16, {"rope_type": "default", "rope_theta": 10000.0})
    q, k = torch.randn(3, 16), torch.randn(3, 8)
    q0 = q.clone()
    out_q, out_k = rope(torch.tensor([0, 1, 2]), q, k)
    assert out_q is q and out_k is k
    assert torch.equal(q[0], q0[0])  # position 0: the identity
    assert not torch.equal(q[2], q0[2])


# DeepSeek-V3's published rope_scaling (factor 40, equal mscales), and a pair of mscales that
# differ (0.707 vs 1), which leaves cos and sin scaled.
YARN_SCALINGS = [
    dict(factor=40.0, mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1),
    dict(factor=4.0, mscale=0.707, mscale_all_dim=1.0, original_max_position_embeddings=128),
]


@pytest.mark.parametrize("scaling", YARN_SCALINGS)
def test_yarn_cos_sin_cache_and_softmax_scale_match_hf(scaling):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale

    config = DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=2,
        qk_rope_head_dim=16,
        max_position_embeddings=512,
        rope_scaling=dict(type="yarn", rope_theta=10000.0, **scaling),
    )
    params = rope_params_from_config(config)
    assert params["rope_type"] == "yarn"
    cos, sin = DeepseekV3RotaryEmbedding(config)(torch.zeros(1, 512, 16), torch.arange(512)[None])
    rope = get_rope(16, 512, params, is_neox_style=False)
    torch.testing.assert_close(rope.cos_sin_cache, torch.cat((cos[0, :, :8], sin[0, :, :8]), dim=-1), rtol=0, atol=0)
    assert 24**-0.5 * yarn_softmax_scale(params) == pytest.approx(yarn_apply_mscale(config.rope_parameters, 24**-0.5))
    assert yarn_softmax_scale(params) > 1.0
