"""Verification steps of speculative decoding replayed from CUDA graphs (docs/spec_decode.md).

A verification step at batch 1 launches as many kernels as a decode step, a few hundred, so
eagerly it is bound by their launch cost. Its shape varies only in how many drafts each request
carries, so it is captured per padded batch size for exactly q = k + 1 query tokens a request:

- request i's tokens are rows i*q .. i*q + n_i (its last token, then its n_i <= k drafts); rows
  after them up to (i + 1)*q are placeholders: token 0, written nowhere (slot -1), at the
  positions after its drafts. The request's context is counted with them (seq_len + q - 1 - n_i)
  so that its real tokens keep their positions and the causal mask hides the placeholders from
  them; the placeholders' own rows are discarded (the logits rows point at real rows only).
- requests past the batch up to the captured size are padded as decode graphs pad them
  (`padding_rows`), with q rows each: written nowhere, after one cached token of block 0 (not a
  fresh prompt, which some attention paths would hand to another kernel, leaving rows unset).

A step replays such a graph when every request completes its known tokens with 1 + n tokens
(n <= k; no prefill chunk), at least one carries drafts (else the decode graphs take the step),
the padded contexts fit `max_model_len`, and the padded batch size is captured. The graphs are
captured up to `disable_by_batch_size` requests when it is set (above it nothing drafts).
Hidden states come back in the padded layout; `TargetStates` of the drafters take the real rows
(`VerificationPadding.token_rows`), so proposers see the same rows as after an eager step.

MLA attention (DeepSeek) serves query length > 1 by a per-request loop on host arrays, which a
graph cannot capture: models with MLA layers verify eagerly.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from shoal.forward_context import AttentionMetadata
from shoal.kernels.fresh_prefill_attention import FreshPrefillPlan
from shoal.workers.cuda_graphs import CudaGraphRunner, capture_sizes, round_up_to_size
from shoal.workers.step_buffers import StepBuffers


def verification_capture_sizes(
    max_num_seqs: int, disable_by_batch_size: int | None, query_len: int, max_num_tokens: int
) -> list[int]:
    """The batch sizes verification graphs are captured at: the decode graphs' sizes, up to the
    batch size above which speculation switches itself off and to what the step buffers hold
    (`query_len` rows a request)."""
    largest = max_num_seqs if disable_by_batch_size is None else min(max_num_seqs, disable_by_batch_size)
    largest = min(largest, max_num_tokens // query_len)
    return capture_sizes(largest) if largest >= 1 else []


def verification_graph_size(
    num_scheduled: np.ndarray,
    num_known: np.ndarray,
    seq_lens: np.ndarray,
    query_len: int,
    sizes: list[int],
    max_model_len: int,
) -> int | None:
    """The captured batch size a step replays its verification at; None when it runs otherwise.

    num_scheduled [num_reqs]: each request's tokens this step; num_known: how many of them are
    known tokens, not drafts (1 for a decode with drafts); seq_lens: each context after the step."""
    if len(num_scheduled) == 0 or not (num_known == 1).all():
        return None
    if not (num_scheduled > 1).any() or (num_scheduled > query_len).any():
        return None
    if (seq_lens - num_scheduled + query_len > max_model_len).any():
        return None
    return round_up_to_size(sizes, len(num_scheduled))


@dataclasses.dataclass(frozen=True)
class VerificationPadding:
    """A verification step laid out for a graph of `size` requests of `query_len` rows each."""

    size: int
    query_len: int
    # The padded batch's host arrays, by step buffer, and its metadata's host arrays.
    arrays: dict[str, np.ndarray]
    query_start_loc: np.ndarray  # [size + 1]
    seq_lens: np.ndarray  # [size]
    # [num_tokens] each real token's row in the padded layout (request order, as the eager step).
    token_rows: np.ndarray
    # [num_reqs] one past each request's last real row in the padded layout.
    query_ends: np.ndarray
    # The step's arrays as an eager step lays them out (the drafters' passes run on those).
    unpadded: dict[str, np.ndarray]


def pad_verification(
    arrays: dict[str, np.ndarray],
    num_scheduled: np.ndarray,
    seq_lens: np.ndarray,
    block_table_rows: np.ndarray,
    block_size: int,
    query_len: int,
    size: int,
) -> VerificationPadding:
    """The step's flat `arrays` (input_ids, positions, slot_mapping per token; the attention's per
    request) padded to `size` requests of `query_len` rows: placeholders after each request's
    tokens, padding requests after the batch. `block_table_rows`: the requests' full block-table
    rows (the padded contexts may reach a block further than the real ones)."""
    num_reqs, q = len(num_scheduled), query_len
    num_scheduled = np.asarray(num_scheduled, dtype=np.int64)
    starts = np.cumsum(num_scheduled) - num_scheduled  # each request's first row, unpadded
    token_rows = np.repeat(np.arange(num_reqs) * q - starts, num_scheduled) + np.arange(int(num_scheduled.sum()))
    padded_seq_lens = np.full(size, q + 1, dtype=np.int64)
    padded_seq_lens[:num_reqs] = seq_lens + q - num_scheduled
    # Each real request's rows continue its positions; a padding request's are 1..q.
    first_positions = np.ones(size, dtype=np.int64)
    first_positions[:num_reqs] = seq_lens - num_scheduled
    positions = np.repeat(first_positions, q) + np.tile(np.arange(q), size)
    input_ids = np.zeros(size * q, dtype=np.int64)
    input_ids[token_rows] = arrays["input_ids"]
    slot_mapping = np.full(size * q, -1, dtype=np.int64)
    slot_mapping[token_rows] = arrays["slot_mapping"]
    num_columns = -(-int(padded_seq_lens.max()) // block_size)
    block_tables = np.zeros((size, num_columns), dtype=np.int32)
    block_tables[:num_reqs] = block_table_rows[:, :num_columns]
    query_start_loc = np.arange(size + 1, dtype=np.int64) * q
    padded = dict(arrays)
    padded.update(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=padded_seq_lens,
        block_tables=block_tables,
        decode_order=np.argsort(-padded_seq_lens, kind="stable").astype(np.int32),
    )
    return VerificationPadding(
        size=size,
        query_len=q,
        arrays=padded,
        query_start_loc=query_start_loc,
        seq_lens=padded_seq_lens,
        token_rows=token_rows,
        query_ends=np.arange(num_reqs) * q + num_scheduled,
        unpadded=arrays,
    )


def no_fresh_prompts(num_reqs: int) -> FreshPrefillPlan:
    """A verification batch's plan: every request a chunk after a cached prefix (which it is),
    given so that the attention does not plan from the host arrays, which a graph cannot read."""
    return FreshPrefillPlan(groups=(), num_decodes=0, num_prefix_chunks=num_reqs)


class VerifyGraphRunner(CudaGraphRunner):
    """Verification forwards captured per padded batch size for `query_len` = k + 1 tokens a
    request; the step's padded inputs (`pad_verification`) are in the buffers when it replays."""

    kind = "verification"

    def __init__(
        self,
        model: torch.nn.Module,
        buffers: StepBuffers,
        sizes: list[int],
        query_len: int,
        max_seq_len: int,
    ) -> None:
        super().__init__(model, buffers, sizes[-1], max_seq_len)
        self.sizes = sizes
        self.query_len = query_len

    def metadata(self, size: int) -> AttentionMetadata:
        b, q = self.buffers, self.query_len
        return AttentionMetadata(
            num_reqs=size,
            num_tokens=size * q,
            max_query_len=q,
            max_seq_len=self.max_seq_len,
            query_start_loc=b["query_start_loc"][: size + 1],
            seq_lens=b["seq_lens"][:size],
            block_tables=b["block_tables"][:size],
            slot_mapping=b["slot_mapping"][: size * q],
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32) * q,
            seq_lens_cpu=torch.full((size,), q + 1, dtype=torch.int32),
            decode_order=b["decode_order"][:size],
            fresh_prefill_plan=no_fresh_prompts(size),
        )

    def _forward(self, size: int) -> torch.Tensor:
        num_tokens = size * self.query_len
        return self.model(self.buffers["input_ids"][:num_tokens], self.buffers["positions"][:num_tokens])

    def _load_padding_only(self, size: int) -> None:
        padding = pad_verification(
            {"input_ids": np.zeros(0, dtype=np.int64), "slot_mapping": np.zeros(0, dtype=np.int64)},
            np.zeros(0, dtype=np.int64),
            np.zeros(0, dtype=np.int64),
            np.zeros((0, 1), dtype=np.int32),
            block_size=self.query_len + 1,  # one block column: a padding request's context
            query_len=self.query_len,
            size=size,
        )
        self.buffers.load(**padding.arrays)
