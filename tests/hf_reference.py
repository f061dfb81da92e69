"""Greedy generation with Hugging Face transformers, the reference shoal is compared against."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch


@dataclass
class HFGreedy:
    token_ids: list[int]
    # Per generated position: the top-k (token id → logprob) of the raw logits.
    top_logprobs: list[dict[int, float]]


@cache
def hf_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool, top_k: int = 5) -> HFGreedy:
    """One prompt at a time (no padding), float32, eager attention. Memoized per checkpoint
    folder like `hf_model` (several test modules ask the same prompts of the same checkpoint; a
    test that changes weights writes them to a folder of its own)."""
    return _hf_greedy(path, tuple(prompt_ids), max_new_tokens, stop_at_eos, top_k)


@cache
@torch.inference_mode()
def _hf_greedy(path: str, prompt_ids: tuple[int, ...], max_new_tokens: int, stop_at_eos: bool, top_k: int) -> HFGreedy:
    model = hf_model(path)
    eos = model.generation_config.eos_token_id if stop_at_eos else None
    out = model.generate(
        torch.tensor([list(prompt_ids)]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    generated = out.sequences[0, len(prompt_ids) :].tolist()
    top = []
    for logits in out.logits:
        values, ids = logits[0].float().log_softmax(-1).topk(top_k)
        top.append(dict(zip(ids.tolist(), values.tolist())))
    return HFGreedy(generated, top)
