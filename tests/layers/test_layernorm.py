from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from shoal.layers.layernorm import RMSNorm


def test_rmsnorm_matches_hf_with_and_without_residual():
    hf = LlamaRMSNorm(32, eps=1e-5)
    hf.weight.data.normal_()
    norm = RMSNorm(32, eps=1e-5)
    norm.weight.weight_loader(norm.weight, hf.weight.data)
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    with torch.no_grad():
        assert torch.equal(norm(x), hf(x))
        expected_residual = x + residual
        out, new_residual = norm(x.clone(), residual.clone())
        assert torch.equal(new_residual, expected_residual)
        assert torch.equal(out, hf(expected_residual))


def test_rmsnorm_starts_at_one():
    assert torch.equal(RMSNorm(4).weight, torch.ones(4))
