"""How each token of a mixture-of-experts layer chooses its experts, as each model family does it.

The router's logits [num_tokens, num_experts] become top-k expert ids and their weights:

- Mixtral (Jiang et al., 2024, "Mixtral of Experts"): softmax over all experts, the top k, then
  renormalized to sum to 1.
- Qwen2-MoE / Qwen3-MoE: the same, renormalized only with `norm_topk_prob`.
- DeepSeek-V2 (DeepSeek-AI, 2024, "DeepSeek-V2", section 2.2): softmax scores, then `greedy` (the
  plain top k) or `group_limited_greedy`: the experts form `n_group` groups, a group's score is
  its best expert's, and only the `topk_group` best groups may be chosen from ("device-limited
  routing"). The weights are scaled by `routed_scaling_factor`.
- DeepSeek-V3 (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report", section 2.1.2): sigmoid
  scores; the choice (not the weights) adds the learned `e_score_correction_bias` (the
  auxiliary-loss-free load balancing, `topk_method="noaux_tc"`); a group's score is the sum of
  its two best experts; the chosen scores are renormalized (`norm_topk_prob`) and scaled by
  `routed_scaling_factor`.

`RoutingConfig.from_hf_config` reads these choices from a Hugging Face config; `select_experts`
applies them. Routing runs in float32 whatever the model's dtype, as the reference models do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from shoal.kernels.softmax_topk import softmax_topk

ScoringFunc = Literal["softmax", "sigmoid"]
TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RoutingConfig:
    """A family's routing rule (see the module docstring); validated on construction."""

    num_experts: int
    top_k: int
    scoring_func: ScoringFunc = "softmax"
    # Divide the chosen weights by their sum (plus `renormalize_eps`).
    renormalize: bool = False
    topk_method: TopkMethod = "greedy"
    # Grouped top-k: experts in `num_expert_groups` equal groups, choices from `topk_groups` of them.
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # DeepSeek-V3 adds 1e-20 to the sum it renormalizes by (a token whose scores all underflow).
    renormalize_eps: float = 0.0

    def __post_init__(self) -> None:
        _require(self.num_experts >= 1, f"num_experts must be at least 1, got {self.num_experts}")
        _require(1 <= self.top_k <= self.num_experts, f"top_k={self.top_k} must be in [1, {self.num_experts}]")
        _require(self.scoring_func in ("softmax", "sigmoid"), f"unknown scoring function {self.scoring_func!r}")
        _require(self.topk_method in TOPK_METHODS, f"topk_method must be one of {TOPK_METHODS}")
        if self.is_grouped:
            groups, chosen = self.num_expert_groups, self.topk_groups
            _require(self.num_experts % groups == 0, f"{self.num_experts} experts do not split into {groups} groups")
            _require(1 <= chosen <= groups, f"topk_group={chosen} must be in [1, n_group={groups}]")
            eligible = chosen * (self.num_experts // groups)
            _require(self.top_k <= eligible, f"top_k={self.top_k} exceeds the {eligible} experts of {chosen} groups")

    @property
    def is_grouped(self) -> bool:
        return self.topk_method in ("group_limited_greedy", "noaux_tc") and self.num_expert_groups > 1

    @property
    def uses_correction_bias(self) -> bool:
        """Whether the router has an `e_score_correction_bias` parameter (noaux_tc)."""
        return self.topk_method == "noaux_tc"

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> RoutingConfig:
        """The routing of a Mixtral, Qwen2/3-MoE or DeepSeek-V2/V3 config (by `model_type`)."""
        model_type = getattr(hf_config, "model_type", "")
        if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"):
            raise ValueError(f"no routing rule for model_type {model_type!r}")
        num_experts, top_k = num_routed_experts(hf_config), int(hf_config.num_experts_per_tok)
        renormalize = bool(getattr(hf_config, "norm_topk_prob", False))
        if model_type == "mixtral":
            return cls(num_experts, top_k, renormalize=True)
        if model_type in ("qwen2_moe", "qwen3_moe"):
            return cls(num_experts, top_k, renormalize=renormalize)
        return cls._deepseek(hf_config, num_experts, top_k, renormalize, is_v3=model_type == "deepseek_v3")

    @classmethod
    def _deepseek(cls, hf_config: Any, num_experts: int, top_k: int, renormalize: bool, is_v3: bool) -> RoutingConfig:
        """V3 always scores by sigmoid with the correction bias (noaux_tc); V2 by softmax with its
        config's `topk_method` (greedy or group_limited_greedy)."""
        method = "noaux_tc" if is_v3 else (getattr(hf_config, "topk_method", None) or "greedy")
        return cls(
            num_experts,
            top_k,
            scoring_func="sigmoid" if is_v3 else "softmax",
            renormalize=renormalize,
            topk_method=method,
            num_expert_groups=int(getattr(hf_config, "n_group", None) or 1),
            topk_groups=int(getattr(hf_config, "topk_group", None) or 1),
            routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", None) or 1.0),
            renormalize_eps=1e-20 if renormalize else 0.0,
        )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def num_routed_experts(hf_config: Any) -> int:
    """The routed experts of a config: `n_routed_experts` (DeepSeek), `num_local_experts`
    (Mixtral, Qwen3-MoE) or `num_experts` (Qwen2-MoE); 0 for a dense model."""
    for key in ("n_routed_experts", "num_local_experts", "num_experts"):
        value = getattr(hf_config, key, None)
        if value:
            return int(value)
    return 0


def select_experts(
    router_logits: torch.Tensor, config: RoutingConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, num_experts] -> (topk_weights float32 [num_tokens, top_k],
    topk_ids int64 [num_tokens, top_k]). The order of a token's k choices is unspecified."""
    plain_softmax = config.scoring_func == "softmax" and not config.is_grouped and not config.uses_correction_bias
    if plain_softmax and config.renormalize_eps == 0.0:
        # Mixtral, Qwen-MoE, DeepSeek-V2(-Lite) greedy: one fused launch on the GPU.
        topk_weights, topk_ids = softmax_topk(router_logits, config.top_k, config.renormalize)
    else:
        topk_weights, topk_ids = _select_by_scores(router_logits, config, correction_bias)
    if config.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * config.routed_scaling_factor
    return topk_weights, topk_ids


def _select_by_scores(
    router_logits: torch.Tensor, config: RoutingConfig, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped, biased and sigmoid rules in torch: (weights, ids) before the scaling factor."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if config.scoring_func == "softmax" else logits.sigmoid()
    choice = scores
    if config.uses_correction_bias:
        if correction_bias is None:
            raise ValueError("noaux_tc routing needs the router's e_score_correction_bias")
        choice = scores + correction_bias.float()
    if config.is_grouped:
        choice = _mask_to_best_groups(choice, config)
    topk_ids = choice.topk(config.top_k, dim=-1).indices  # [num_tokens, top_k]
    topk_weights = scores.gather(1, topk_ids)  # the choice's bias is not part of the weight
    if config.renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + config.renormalize_eps)
    return topk_weights, topk_ids


def _mask_to_best_groups(choice: torch.Tensor, config: RoutingConfig) -> torch.Tensor:
    """`choice` with every expert outside the token's `topk_groups` best groups set to -inf.

    A group scores by its best expert (group_limited_greedy) or by the sum of its two best
    (noaux_tc, whose groups hold at least two experts in every released config)."""
    num_tokens = choice.shape[0]
    grouped = choice.view(num_tokens, config.num_expert_groups, -1)  # [num_tokens, n_group, experts_per_group]
    if config.topk_method == "noaux_tc":
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values  # [num_tokens, n_group]
    best_groups = group_scores.topk(config.topk_groups, dim=-1).indices  # [num_tokens, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(num_tokens, -1)
