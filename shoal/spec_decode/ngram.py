"""N-gram prompt lookup (Saxena, 2023, "Prompt Lookup Decoding"): a request's next tokens are
guessed from its own tokens, prompt and output, with no draft model.

For each request, find the longest n in [prompt_lookup_min, prompt_lookup_max] such that the row's
last n tokens occurred earlier in the row; take the earliest such occurrence and propose the
tokens that followed it, up to k and not past the row's end.

Why the earliest occurrence: on the workloads prompt lookup serves (summarize, rewrite or
continue a given passage, edit code) the text being copied is the prompt, which comes first, and
the earliest occurrence is the one most often followed by k tokens before the row's end. It is
also vLLM's choice (its longest-match search keeps the earliest position among the longest
matches), so the acceptance rates of the two engines compare on the same workload.

Vectorized across the batch with numpy: one comparison of every row against its last token
gives the candidate occurrences (positions holding that token), and each further offset
m < prompt_lookup_max is checked on the surviving candidates only (a loop over m, none over
tokens). Rows are taken in chunks of similar length, so a batch of short rows and one long row
costs what the tokens cost, not num_rows x the longest row.
"""

from __future__ import annotations

import numpy as np

from shoal.spec_decode.proposer import Drafts, Proposer, ProposerInputs

# Tokens (rows x columns) one chunk of rows may copy and compare at once: bounds the temporary
# arrays at a few tens of MB whatever max_model_len is.
CHUNK_TOKENS = 1 << 22


class NgramProposer(Proposer):
    """Prompt lookup over each request's row of the input batch (no model, no device work)."""

    method = "ngram"

    def propose(self, inputs: ProposerInputs) -> Drafts:
        low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        assert low is not None and high is not None  # filled in by SpeculativeConfig
        token_ids, num_draft_tokens = propose_ngram_drafts(
            inputs.token_ids,
            inputs.slots,
            inputs.num_tokens,
            self.num_speculative_tokens,
            low,
            high,
            inputs.max_num_drafts,
        )
        return Drafts(token_ids=token_ids, num_draft_tokens=num_draft_tokens)


def propose_ngram_drafts(
    token_ids: np.ndarray,
    rows: np.ndarray,
    num_tokens: np.ndarray,
    num_speculative_tokens: int,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
    max_num_drafts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Drafts for the requests in `rows` of `token_ids` ([max_num_reqs, max_model_len], a
    request's prompt then output; `num_tokens[i]` of row `rows[i]` are its tokens).

    Returns (drafts [num_reqs, k] int64, -1 after each row's drafts; num_drafts [num_reqs]).
    A row gets no drafts when no n-gram of its last tokens matches earlier. A row's drafts
    stop at its end, at `max_num_drafts[i]` when given (the caller's own caps: a request about
    to reach max_tokens, or one whose speculation is off), and before position max_model_len
    (the array's width: a draft there could not be scored).
    """
    k = num_speculative_tokens
    rows = np.asarray(rows, dtype=np.int64)
    num_tokens = np.asarray(num_tokens, dtype=np.int64)
    num_reqs = len(rows)
    drafts = np.full((num_reqs, k), -1, dtype=np.int64)
    num_drafts = np.zeros(num_reqs, dtype=np.int64)
    caps = np.minimum(k, token_ids.shape[1] - num_tokens)
    if max_num_drafts is not None:
        caps = np.minimum(caps, max_num_drafts)
    # Rows that could match: at least one token before the last, and room for a draft.
    candidates = np.flatnonzero((num_tokens >= 2) & (caps > 0))
    order = candidates[np.argsort(num_tokens[candidates], kind="stable")]  # shortest first
    for chunk in _chunks_by_length(num_tokens[order]):
        index = order[chunk]
        found, starts = _earliest_longest_matches(
            token_ids, rows[index], num_tokens[index], prompt_lookup_min, prompt_lookup_max
        )
        index, starts = index[found], starts[found]
        counts = np.minimum(caps[index], num_tokens[index] - starts)  # >= 1: a match ends before the last token
        offsets = np.arange(k)
        columns = np.minimum(starts[:, None] + offsets, token_ids.shape[1] - 1)  # [n, k]
        taken = token_ids[rows[index][:, None], columns]
        drafts[index] = np.where(offsets < counts[:, None], taken, -1)
        num_drafts[index] = counts
    return drafts, num_drafts


def _chunks_by_length(sorted_lengths: np.ndarray) -> list[slice]:
    """Consecutive slices of rows sorted by length, each of at most CHUNK_TOKENS padded tokens
    (its row count times its longest row), and at least one row."""
    chunks, start, num_rows = [], 0, len(sorted_lengths)
    while start < num_rows:
        # Taking rows start..end-1 pads them to sorted_lengths[end-1].
        padded = np.arange(1, num_rows - start + 1) * sorted_lengths[start:]
        end = start + max(1, int(np.searchsorted(padded, CHUNK_TOKENS, side="right")))
        chunks.append(slice(start, end))
        start = end
    return chunks


def _earliest_longest_matches(
    token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray, min_n: int, max_n: int
) -> tuple[np.ndarray, np.ndarray]:
    """For each row: whether some n in [min_n, max_n] has its last n tokens occurring earlier, and
    where the tokens after the earliest occurrence of the longest such n-gram start.

    A candidate is an earlier position `end` (end <= length - 2) holding the row's last token; its
    match length is the number of offsets m = 0, 1, ... (up to max_n) with
    tokens[end - m] == tokens[length - 1 - m]. Occurrences may overlap the row's suffix."""
    width = int(lengths.max())
    tokens = token_ids[rows, :width]  # [num_rows, width], a copy
    last = tokens[np.arange(len(rows)), lengths - 1]
    # flatnonzero, then row and column: several times faster than a 2-D nonzero.
    candidate_row, candidate_end = np.divmod(np.flatnonzero(tokens == last[:, None]), width)
    earlier = candidate_end < lengths[candidate_row] - 1  # not the last token itself, nor a row's padding
    candidate_row, candidate_end = candidate_row[earlier], candidate_end[earlier]
    match_len = np.ones(len(candidate_row), dtype=np.int64)
    alive = np.ones(len(candidate_row), dtype=bool)
    for m in range(1, max_n):
        alive &= candidate_end >= m
        live = np.flatnonzero(alive)
        r = candidate_row[live]
        alive[live] = tokens[r, candidate_end[live] - m] == tokens[r, lengths[r] - 1 - m]
        match_len += alive
    keep = match_len >= min_n
    candidate_row, candidate_end, match_len = candidate_row[keep], candidate_end[keep], match_len[keep]
    found = np.zeros(len(rows), dtype=bool)
    starts = np.zeros(len(rows), dtype=np.int64)
    if len(candidate_row) == 0:
        return found, starts
    # Candidates come sorted by (row, end): per row, the first one of the row's longest length.
    longest = np.zeros(len(rows), dtype=np.int64)
    np.maximum.at(longest, candidate_row, match_len)
    best = np.flatnonzero(match_len == longest[candidate_row])
    best_rows, first = np.unique(candidate_row[best], return_index=True)
    found[best_rows] = True
    starts[best_rows] = candidate_end[best[first]] + 1
    return found, starts
