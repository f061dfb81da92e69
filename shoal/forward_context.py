"""Per-forward state: the attention metadata of the batch being run, scoped by a context
manager so that model code can read it without threading it through every layer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from shoal.kernels.fresh_prefill_attention import FreshPrefillPlan


@dataclass
class AttentionMetadata:
    """Where each token of a flat batch lives in the paged KV cache.

    The batch holds `num_reqs` requests back to back: request i's `query_len_i` new tokens are
    rows `query_start_loc[i]:query_start_loc[i+1]`. Its context after this step is
    `seq_lens[i]` tokens, of which the last `query_len_i` are the new ones (so new token j of
    request i sits at position `seq_lens[i] - query_len_i + j` and attends causally to every
    position up to its own). `block_tables[i, k]` is the cache block holding positions
    `[k * block_size, (k + 1) * block_size)`; `slot_mapping[t] = block * block_size + offset`
    is where token t's K and V are written (-1: not written, e.g. padding).
    """

    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    # Host copies of the two small index arrays, for kernels that loop over requests.
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32
    # True when every request computes exactly one token (a pure decode step).
    is_decode_only: bool = False
    # [num_reqs] int32: the requests, longest context first: the order the decode kernel starts
    # them in (None: batch order).
    decode_order: torch.Tensor | None = None
    # A batch with prefill tokens when fresh prompts go to SDPA (`fresh_prefill_attention.BY_SDPA`):
    # its fresh prompts grouped for dense attention and what is left for the paged kernels, from
    # the host arrays (built once per step by the model runner; None where nobody built it: the
    # attention builds it from the host copies).
    fresh_prefill_plan: FreshPrefillPlan | None = None
    # Anything an attention backend precomputes for this batch (e.g. split-K work plans).
    backend_state: Any = None


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None) -> Iterator[ForwardContext]:
    """Make `attn_metadata` visible to the attention layers for the duration of one forward."""
    global _current
    previous = _current
    _current = ForwardContext(attn_metadata)
    try:
        yield _current
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside set_forward_context(...)")
    return _current
