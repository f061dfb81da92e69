"""Causal attention of the fresh prompts of a batch as dense flash attention (PyTorch's
`scaled_dot_product_attention`), beside the paged kernels that serve the rest.

A fresh prompt is a request whose new tokens are its whole context (query_len > 1 and seq_len
== query_len: the first chunk of a prompt without a prefix-cache hit). Its tokens attend only to
each other, so the keys and values computed this step are all it needs, already contiguous in
the step's rows: no block table, no cache reads. Consecutive fresh prompts of equal length are
one SDPA call on a [num_prompts, heads, prompt_len, head_size] view of their rows.

Off by default (SHOAL_FRESH_PREFILL_ATTENTION=paged): the kernel is faster per call, but one call
per run of equal-length prompts loses on ragged batches (numbers below and in BENCHMARKS.md).

`plan_fresh_prefills` reads host arrays only, so the model runner builds the plan once per step
(`AttentionMetadata.fresh_prefill_plan`) without a device sync.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shoal import envs

# Whether fresh prompts leave the paged kernels at all (read at call time by the model runner,
# which plans them, `paged_attention`, which hands the Triton kernel this step's keys, and that
# kernel). The kernel alone is faster (causal prefill attention in TFLOP/s, unified kernel vs
# SDPA, `python3 benchmarks/bench_prefill_attention.py`, one H200, 2026-12-01: Llama-8B heads 8
# prompts x 1,024 tokens 230 vs 435, 2 x 1,024 70 vs 327, 2 x 4,096 278 vs 563; Qwen3-0.6B heads
# 16 x 512 57 vs 307), but one call per run of equal-length prompts loses on ragged batches, so
# it is off by default (BENCHMARKS.md, "Fresh prompts through SDPA").
BY_SDPA = envs.SHOAL_FRESH_PREFILL_ATTENTION != "paged"
# SDPA's backends under SHOAL_FRESH_PREFILL_ATTENTION=flash: flash and memory-efficient attention.
# Left to choose (=sdpa), SDPA also takes backends that cost more per new prompt length: one
# H200, the nano-vllm protocol (256 prompts of 100-1,024 tokens) on Qwen3-0.6B's shape ran 8,358
# output tok/s that way, 19,499 with these two, 23,846 with the paged kernel (the default).
SDPA_BACKENDS = (
    None
    if envs.SHOAL_FRESH_PREFILL_ATTENTION == "sdpa"
    else [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
)


@dataclass(frozen=True)
class PromptGroup:
    """`num_prompts` fresh prompts of `prompt_len` tokens each, back to back in the batch: query
    rows `first_row : first_row + num_prompts * prompt_len`."""

    first_row: int
    num_prompts: int
    prompt_len: int


@dataclass(frozen=True)
class FreshPrefillPlan:
    """A batch's requests by who serves them: one-token requests (the decode kernel), fresh
    prompts (SDPA, in `groups`) and prefill chunks after a cached prefix (the paged kernel)."""

    groups: tuple[PromptGroup, ...]
    num_decodes: int  # requests with one new token
    num_prefix_chunks: int  # requests with more than one new token after context_len > 0 cached ones


def plan_fresh_prefills(query_start_loc: np.ndarray, seq_lens: np.ndarray) -> FreshPrefillPlan:
    """query_start_loc [num_reqs + 1], seq_lens [num_reqs], on the host. Only adjacent requests
    share a group, so that a group's rows are one contiguous slice."""
    query_lens = np.diff(query_start_loc)
    prefill = query_lens > 1
    fresh = prefill & (seq_lens == query_lens)
    groups: list[PromptGroup] = []
    previous = -2
    for i in np.flatnonzero(fresh).tolist():
        prompt_len = int(query_lens[i])
        if i == previous + 1 and groups[-1].prompt_len == prompt_len:
            groups[-1] = replace(groups[-1], num_prompts=groups[-1].num_prompts + 1)
        else:
            groups.append(PromptGroup(int(query_start_loc[i]), 1, prompt_len))
        previous = i
    return FreshPrefillPlan(
        groups=tuple(groups),
        num_decodes=int(np.count_nonzero(query_lens == 1)),
        num_prefix_chunks=int(np.count_nonzero(prefill & ~fresh)),
    )


def fresh_prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    groups: tuple[PromptGroup, ...],
    scale: float,
) -> None:
    """Write the groups' rows of `out` [num_tokens, num_heads, head_size]; query likewise, key
    and value [num_tokens, num_kv_heads, head_size] (views with any token stride will do)."""
    for group in groups:
        rows = slice(group.first_row, group.first_row + group.num_prompts * group.prompt_len)
        prompts = (group.num_prompts, group.prompt_len)
        q, k, v = (x[rows].unflatten(0, prompts).transpose(1, 2) for x in (query, key, value))
        # q [num_prompts, num_heads, prompt_len, head_size], k and v with num_kv_heads; each
        # prompt's diagonal starts at its first token, which is SDPA's is_causal.
        attn = _sdpa(q, k, v, scale)
        out[rows].unflatten(0, prompts).copy_(attn.transpose(1, 2))  # [num_prompts, prompt_len, num_heads, head_size]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    backends = sdpa_kernel(SDPA_BACKENDS) if SDPA_BACKENDS is not None and q.is_cuda else nullcontext()
    with backends:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
