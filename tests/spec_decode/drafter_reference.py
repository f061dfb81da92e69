"""Plain reference computations of the EAGLE-3 head and DeepSeek-V3's next-token module, from the
raw safetensors, and the greedy chain of drafts they give.

`Eagle3Reference` and `EagleReference` are the published architectures written out in torch (no shoal layer, no cache:
full causal attention over the whole sequence). `MtpReference` writes the module's own parts
(enorm, hnorm, eh_proj, the shared head's norm) in torch around transformers' DeepSeek-V3 decoder
layer, built by loading the checkpoint into a transformers model one layer deeper than the config
says (so that its layer L is the module's decoder layer, with MLA and the experts as transformers
computes them).

`reference_drafts` recomputes the whole sequence for every draft: row t reads the drafter's hidden
input at t (the target's features for t < m - 1, then the drafter's own output at t - 1) and the
token at t + 1; the draft is the argmax of the last row's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_halves(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE over the halves of each head (Llama's layout): x [T, heads, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, d / 2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def causal_mask(num_tokens: int) -> torch.Tensor:
    return torch.full((num_tokens, num_tokens), float("-inf")).triu(1)


def attention(
    w: dict[str, torch.Tensor], prefix: str, config: dict, x: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Llama's grouped-query self-attention of `prefix`'s q/k/v/o_proj over x [T, in], causal."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, n = config["hidden_size"] // heads, len(x)
    q = (x @ w[f"{prefix}self_attn.q_proj.weight"].T).view(n, heads, head_dim)
    k = (x @ w[f"{prefix}self_attn.k_proj.weight"].T).view(n, kv_heads, head_dim)
    v = (x @ w[f"{prefix}self_attn.v_proj.weight"].T).view(n, kv_heads, head_dim)
    q, k = rotate_halves(q, positions, config["rope_theta"]), rotate_halves(k, positions, config["rope_theta"])
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim**0.5 + causal_mask(n)
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * head_dim)
    return out @ w[f"{prefix}self_attn.o_proj.weight"].T


def mlp(w: dict[str, torch.Tensor], prefix: str, y: torch.Tensor) -> torch.Tensor:
    gate, up = y @ w[f"{prefix}mlp.gate_proj.weight"].T, y @ w[f"{prefix}mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[f"{prefix}mlp.down_proj.weight"].T


class Eagle3Reference:
    def __init__(self, head: Path, target_embedding: torch.Tensor):
        self.w = load_file(Path(head) / "model.safetensors")
        self.config = json.loads((Path(head) / "config.json").read_text())
        self.embedding = self.w.get("embed_tokens.weight", target_embedding)

    def features(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's three layers' features [T, 3 * hidden] -> g [T, hidden]."""
        return aux @ self.w["fc.weight"].T

    def __call__(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """g [T, hidden], the token after each position [T] -> o [T, hidden]."""
        w, eps, m = self.w, self.config["rms_norm_eps"], "midlayer."
        x = torch.cat(
            (rms_norm(self.embedding[tokens], w[f"{m}input_layernorm.weight"], eps),
             rms_norm(hidden, w[f"{m}hidden_norm.weight"], eps)),
            dim=-1,
        )  # fmt: skip
        a = hidden + attention(w, m, self.config, x, positions)
        return a + mlp(w, m, rms_norm(a, w[f"{m}post_attention_layernorm.weight"], eps))

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        return rms_norm(o, self.w["norm.weight"], self.config["rms_norm_eps"]) @ self.w["lm_head.weight"].T

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.w["d2t"][draft_ids]


class EagleReference:
    """An EAGLE head of one layer: fc over [embedding; target feature], a Llama layer without its
    input norm, the target's LM head."""

    def __init__(self, head: Path, target: Path):
        self.w = load_file(Path(head) / "model.safetensors")
        self.config = json.loads((Path(head) / "config.json").read_text())
        target_weights = load_file(Path(target) / "model.safetensors")
        self.embedding = self.w.get("embed_tokens.weight", target_weights["model.embed_tokens.weight"])
        self.lm_head = target_weights["lm_head.weight"]

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def __call__(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        w, eps, m = self.w, self.config["rms_norm_eps"], "layers.0."
        x = torch.cat((self.embedding[tokens], hidden), dim=-1) @ w["fc.weight"].T + w["fc.bias"]
        a = x + attention(w, m, self.config, x, positions)
        return a + mlp(w, m, rms_norm(a, w[f"{m}post_attention_layernorm.weight"], eps))

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        return o @ self.lm_head.T

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


class MtpReference:
    def __init__(self, path: Path, hf_model: torch.nn.Module | None = None):
        """`hf_model`: transformers' model of `path`'s weights with num_hidden_layers + 1 layers
        (built here from `path` when None)."""
        config = json.loads((Path(path) / "config.json").read_text())
        self.index, self.eps = config["num_hidden_layers"], config["rms_norm_eps"]
        if hf_model is None:
            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_pretrained(
                path, num_hidden_layers=self.index + 1, dtype=torch.float32, attn_implementation="eager"
            ).eval()
        self.hf = hf_model
        tensors = load_file(Path(path) / "model.safetensors")
        p = f"model.layers.{self.index}."
        self.w = {name[len(p) :]: t for name, t in tensors.items() if name.startswith(p)}

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        w = self.w
        e = rms_norm(w["embed_tokens.weight"][tokens], w["enorm.weight"], self.eps)
        h = rms_norm(hidden, w["hnorm.weight"], self.eps)
        x = (torch.cat((e, h), dim=-1) @ w["eh_proj.weight"].T)[None]  # [1, T, hidden]
        position_ids = positions[None]
        layer = self.hf.model.layers[self.index]
        out = layer(
            x,
            attention_mask=causal_mask(len(tokens))[None, None],
            position_ids=position_ids,
            position_embeddings=self.hf.model.rotary_emb(x, position_ids),
        )
        return (out[0] if isinstance(out, tuple) else out)[0]

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        return rms_norm(o, self.w["shared_head.norm.weight"], self.eps) @ self.w["shared_head.head.weight"].T

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


@torch.no_grad()
def reference_drafts(reference, target_states: torch.Tensor, tokens: list[int], k: int) -> list[int]:
    """The greedy chain of k drafts after `tokens` (m of them; the last one just emitted), from
    the target's states at positions 0 .. m - 2 ([m - 1, ...]: EAGLE-3's three layers' features,
    MTP's final hidden states)."""
    hidden = reference.features(target_states)
    next_tokens = list(tokens[1:])
    drafts: list[int] = []
    for _ in range(k):
        out = reference(hidden, torch.tensor(next_tokens), torch.arange(len(next_tokens)))
        draft = int(reference.to_target(reference.logits(out[-1]).argmax()))
        drafts.append(draft)
        hidden = torch.cat((hidden, out[-1:]))
        next_tokens.append(draft)
    return drafts
