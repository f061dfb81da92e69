"""LoRA on the routed experts: a `FusedMoE` made a LoRA layer in place, its adapters' per-expert A
and B in two slot holders (gate_up and down) that live in the same GPU slots, LRU and CPU cache as
the projections' (shoal/lora/slots.py):

    gate_up: lora_a [max_loras, E_rank, R, hidden]        lora_b [max_loras, E_rank, 2 * I_rank, R]
    down:    lora_a [max_loras, E_rank, R, I_rank]        lora_b [max_loras, E_rank, hidden, R]

E_rank and I_rank are the experts and intermediate rows this rank holds (`ExpertPlacement`), and A
and B are cut like the base weights: tensor parallelism keeps gate_up's A whole and B's gate and
up rows of this rank, down's A columns of this rank and B whole, so both deltas are partial sums
that the MoE block's one all-reduce adds up with the base's; expert parallelism keeps the rank's
experts whole. (`fully_sharded_loras` cuts nothing more here.)

The forward runs `fused_moe_lora` (shoal/kernels/fused_moe_lora.py) when a token of the step may
have an experts' delta, else the plain `fused_moe`: base-model steps, and steps whose adapters
target no experts, cost nothing extra in eager mode (`TokenSlots.experts_active`).
"""

from __future__ import annotations

import logging

import torch

from shoal.distributed.parallel_state import get_tp_group
from shoal.kernels.fused_moe_lora import fused_moe_lora, warm_up_fused_moe_lora
from shoal.layers.moe.experts import FusedMoE, UnquantizedMoEMethod
from shoal.lora.layers import TokenSlots, check_shape

logger = logging.getLogger(__name__)


class ExpertSlots:
    """One stacked projection ("gate_up_proj" or "down_proj") of one `FusedMoE`: its adapters'
    slot tensors, and each adapter's share of them for this rank (`slot_tensors`)."""

    def __init__(self, experts: FusedMoE, prefix: str, projection: str, max_loras: int, rank: int, dtype: torch.dtype):
        self.experts, self.projection, self.lora_rank = experts, projection, rank
        self.module_name = f"{prefix}.{projection}"
        empty_a, empty_b = self.slot_tensors({})
        device = next(experts.parameters()).device
        self.lora_a = torch.zeros(max_loras, *empty_a.shape, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, *empty_b.shape, dtype=dtype, device=device)

    def slot_tensors(self, modules: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) of one adapter, zero where it has no such module or a smaller rank."""
        p, hidden = self.experts.placement, self.experts.hidden_size
        in_size, out_size = (
            (hidden, 2 * p.intermediate_per_rank) if self.is_gate_up else (p.intermediate_per_rank, hidden)
        )
        lora_a = torch.zeros(p.num_local_experts, self.lora_rank, in_size)
        lora_b = torch.zeros(p.num_local_experts, out_size, self.lora_rank)
        if self.module_name not in modules:
            return lora_a, lora_b
        a, b = modules[self.module_name]
        rank = a.shape[1]
        full_in, full_out = (hidden, 2 * p.intermediate_size) if self.is_gate_up else (p.intermediate_size, hidden)
        check_shape(self.module_name, "lora_A", a, (p.num_experts, rank, full_in))
        check_shape(self.module_name, "lora_B", b, (p.num_experts, full_out, rank))
        a, b = a[p.local_experts], b[p.local_experts]
        rows = p.intermediate_rows
        if self.is_gate_up:  # this rank's gate rows, then its up rows (w13's layout)
            up_rows = slice(p.intermediate_size + rows.start, p.intermediate_size + rows.stop)
            b = torch.cat([b[:, rows], b[:, up_rows]], dim=1)
        else:
            a = a[:, :, rows]
        lora_a[:, :rank] = a
        lora_b[:, :, :rank] = b
        return lora_a, lora_b

    @property
    def is_gate_up(self) -> bool:
        return self.projection == "gate_up_proj"


class LoRAFusedMoE:
    """What the LoRA form of a `FusedMoE` adds: the experts' deltas in `forward`."""

    gate_up_lora: ExpertSlots
    down_lora: ExpertSlots
    token_slots: TokenSlots

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if not self.token_slots.experts_active:
            return super().forward(hidden_states, topk_weights, topk_ids)  # type: ignore[misc]
        base: FusedMoE = self  # type: ignore[assignment]
        w13: torch.Tensor = base.w13_weight  # type: ignore[assignment]
        w2: torch.Tensor = base.w2_weight  # type: ignore[assignment]
        gate_up, down = self.gate_up_lora, self.down_lora
        out = fused_moe_lora(
            hidden_states, w13, w2, topk_weights, topk_ids, base.expert_map,
            gate_up.lora_a, gate_up.lora_b, down.lora_a, down.lora_b, self.token_slots.slots[: hidden_states.shape[0]],
        )  # fmt: skip
        return get_tp_group().all_reduce(out) if base.reduce_results else out

    @torch.inference_mode()
    def warm_up_kernels(self, max_num_tokens: int) -> None:
        """The base experts' warm-up, then the LoRA form's (GPU; nothing on CPU)."""
        super().warm_up_kernels(max_num_tokens)  # type: ignore[misc]
        base: FusedMoE = self  # type: ignore[assignment]
        w13: torch.Tensor = base.w13_weight  # type: ignore[assignment]
        w2: torch.Tensor = base.w2_weight  # type: ignore[assignment]
        lora = (self.gate_up_lora.lora_a, self.gate_up_lora.lora_b, self.down_lora.lora_a, self.down_lora.lora_b)
        warm_up_fused_moe_lora(w13, w2, base.top_k, max_num_tokens, base.expert_map, lora)


def add_expert_lora(
    experts: FusedMoE, prefix: str, max_loras: int, max_lora_rank: int, token_slots: TokenSlots, dtype: torch.dtype
) -> list[ExpertSlots]:
    """Make `experts` (named `prefix`) a LoRA layer in place, with `max_loras` empty slots for
    each projection; returns the two slot holders. Only unquantized experts take LoRA (raises
    ValueError for others: the caller refuses adapters that reach them)."""
    if not isinstance(experts.moe_method, UnquantizedMoEMethod):
        raise ValueError(
            f"LoRA on the MoE experts of {prefix} is not supported with {type(experts.moe_method).__name__} "
            "(only unquantized experts)"
        )
    base_cls = type(experts)
    experts.__class__ = type(f"LoRA{base_cls.__name__}", (LoRAFusedMoE, base_cls), {})
    lora: LoRAFusedMoE = experts  # type: ignore[assignment]
    lora.token_slots = token_slots
    lora.gate_up_lora = ExpertSlots(experts, prefix, "gate_up_proj", max_loras, max_lora_rank, dtype)
    lora.down_lora = ExpertSlots(experts, prefix, "down_proj", max_loras, max_lora_rank, dtype)
    return [lora.gate_up_lora, lora.down_lora]


class ModelExperts:
    """The model's routed experts as LoRA sees them: the slot holders of the experts that take
    LoRA, and the names of those that cannot (quantized: an adapter reaching them is refused)."""

    def __init__(
        self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, token_slots: TokenSlots, dtype: torch.dtype
    ):
        self.holders: list[ExpertSlots] = []
        self.refused: dict[str, str] = {}  # prefix → why
        for name, module in list(model.named_modules()):
            if not isinstance(module, FusedMoE):
                continue
            try:
                self.holders += add_expert_lora(module, name, max_loras, max_lora_rank, token_slots, dtype)
            except ValueError as exc:
                self.refused[name] = str(exc)
        if self.holders:
            num_bytes = sum(t.numel() * t.element_size() for h in self.holders for t in (h.lora_a, h.lora_b))
            logger.info(
                "LoRA on the routed experts of %d layers: %.2f GiB of slots (max_loras x experts x max_lora_rank)",
                len(self.holders) // 2, num_bytes / 2**30,
            )  # fmt: skip

    def check(self, modules: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Refuse (ValueError) an adapter's experts' modules that no layer here can serve: on a
        model without routed experts, or on quantized ones. (Those of another pipeline stage's
        layers are that stage's to check.)"""
        names = [m for m in modules if m.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
        if names and not self.holders and not self.refused:
            raise ValueError(f"the adapter has LoRA on MoE experts ({names[0]}), but the model has no routed experts")
        for name in names:
            why = self.refused.get(name.rsplit(".", 1)[0])
            if why is not None:
                raise ValueError(why)

    @staticmethod
    def has_experts(modules: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> bool:
        return any(a.dim() == 3 for a, _ in modules.values())
