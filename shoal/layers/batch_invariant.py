"""`batch_invariant=True`: a loaded model turned into one whose every token's result does not
depend on the batch it runs in (docs/batch_invariance.md).

The switch is made once, at load (`make_batch_invariant`), by swapping each batch-shaped piece
for its batch-invariant twin: a linear layer's `linear_method`, the experts' `moe_method`, and
the class of the norms, the attention layers, the router and the LM head (subclasses that
override one method each). The default mode's modules keep their code and their speed; nothing
checks the mode per call.

Everything between those pieces is elementwise (embedding lookups, rotary embeddings, residual
adds) and so already per token. What the swap cannot make invariant it refuses: fp8 linear
methods and experts, multi-head latent attention.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from shoal.forward_context import AttentionMetadata
from shoal.kernels import batch_invariant as bi
from shoal.kernels.batch_invariant_attention import paged_attention
from shoal.layers.attention import Attention
from shoal.layers.embedding import ParallelLMHead
from shoal.layers.layernorm import RMSNorm
from shoal.layers.linear import LinearBase
from shoal.layers.moe.experts import FusedMoE, UnquantizedMoEMethod
from shoal.layers.moe.gate import MoEGate
from shoal.layers.moe.routing import select_experts
from shoal.layers.moe.shared_experts import SharedExpertGate
from shoal.layers.quantization.base import UnquantizedLinearMethod

logger = logging.getLogger(__name__)


class BatchInvariantLinearMethod(UnquantizedLinearMethod):
    """Float weights through the batch-invariant GEMM; SwiGLU's activation on the same tiles."""

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return bi.linear(x, layer.weight, bias)

    def apply_swiglu(self, layer: Any, gate_up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return bi.linear(bi.silu_and_mul_rows(gate_up), layer.weight, bias)


class BatchInvariantMoEMethod(UnquantizedMoEMethod):
    """Each expert's GEMMs batch-invariant, its outputs added in expert order."""

    def apply(
        self, layer: FusedMoE, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return bi.fused_moe(hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.expert_map)


class BatchInvariantRMSNorm(RMSNorm):
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return bi.rms_norm(x, self.weight, self.eps)
        residual.add_(x)  # in place, as the default norm's fused add
        x.copy_(bi.rms_norm(residual, self.weight, self.eps))
        return x, residual


class BatchInvariantAttention(Attention):
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        assert self.kv_cache is not None
        return paged_attention(q, self.kv_cache, attn_metadata, self.scale)


class BatchInvariantMoEGate(MoEGate):
    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = bi.linear(hidden_states.to(self.weight.dtype), self.weight, None)  # [num_tokens, num_experts]
        # The top-k rule row by row, on row tiles: a softmax over the experts is a reduction.
        choices = [
            select_experts(tile, self.routing, self.e_score_correction_bias) for tile in logits.split(bi.ROW_TILE)
        ]
        return torch.cat([w for w, _ in choices]), torch.cat([i for _, i in choices])


class BatchInvariantSharedExpertGate(SharedExpertGate):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(bi.linear(x, self.weight, None))  # [num_tokens, 1]


class BatchInvariantLMHead(ParallelLMHead):
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        from shoal.distributed.parallel_state import get_tp_group

        logits = bi.linear(hidden_states, self.weight, self.bias)  # [num_tokens, vocab_per_rank]
        logits = get_tp_group().all_gather(logits, dim=-1)  # [num_tokens, vocab_padded]
        return logits[..., : self.num_embeddings]


# Default class -> its batch-invariant subclass (the subclass adds no state, so the swap is a
# change of class).
_CLASS_SWAPS: dict[type[nn.Module], type[nn.Module]] = {
    RMSNorm: BatchInvariantRMSNorm,
    Attention: BatchInvariantAttention,
    MoEGate: BatchInvariantMoEGate,
    SharedExpertGate: BatchInvariantSharedExpertGate,
    ParallelLMHead: BatchInvariantLMHead,
}


def make_batch_invariant(model: nn.Module) -> nn.Module:
    """Turn `model` (loaded, weights processed) batch-invariant in place; ValueError for a
    module the mode has no invariant form of."""
    for name, module in model.named_modules():
        _check_supported(name, module)
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.linear_method = BatchInvariantLinearMethod()
        elif isinstance(module, FusedMoE):
            module.moe_method = BatchInvariantMoEMethod()
        swap = _CLASS_SWAPS.get(type(module))
        if swap is not None:
            module.__class__ = swap
    logger.info("batch_invariant: %s runs batch-invariant GEMMs, norms and attention", type(model).__name__)
    return model


def _check_supported(name: str, module: nn.Module) -> None:
    from shoal.layers.mla import MLAAttention

    if isinstance(module, LinearBase) and type(module.linear_method) is not UnquantizedLinearMethod:
        raise ValueError(
            f"batch_invariant supports float weights only; {name} is {type(module.linear_method).__name__}"
        )
    if isinstance(module, FusedMoE) and type(module.moe_method) is not UnquantizedMoEMethod:
        raise ValueError(f"batch_invariant supports float experts only; {name} is {type(module.moe_method).__name__}")
    if isinstance(module, MLAAttention):
        raise ValueError(f"batch_invariant does not support multi-head latent attention yet ({name})")
    for cls in _CLASS_SWAPS:
        if isinstance(module, cls) and type(module) not in (cls, _CLASS_SWAPS[cls]):
            raise ValueError(f"batch_invariant has no invariant form of {type(module).__name__} ({name})")
