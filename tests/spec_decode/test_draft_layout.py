"""`DraftLayout`: the rows of each request's drafts and bonus position, and the hidden-state rows
the verification logits come from."""

from __future__ import annotations

import numpy as np
import pytest

from shoal.spec_decode.draft_layout import DraftLayout


def test_rows_of_each_request() -> None:
    layout = DraftLayout.of([2, 0, 3])
    assert (layout.num_reqs, layout.num_drafts, layout.num_rows) == (3, 5, 8)
    assert layout.first_row.tolist() == [0, 3, 4]
    assert layout.bonus_rows.tolist() == [2, 3, 7]
    assert layout.first_draft.tolist() == [0, 2, 2]
    assert layout.draft_req.tolist() == [0, 0, 2, 2, 2]
    assert layout.draft_pos.tolist() == [0, 1, 0, 1, 2]
    assert layout.draft_rows.tolist() == [0, 1, 4, 5, 6]
    assert layout.row_req.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]


def test_no_drafts_is_one_row_a_request() -> None:
    layout = DraftLayout.of([0, 0])
    assert layout.first_row.tolist() == [0, 1] and layout.num_drafts == 0
    assert layout.logits_indices(np.array([5, 6])).tolist() == [4, 5]  # each request's last token
    assert DraftLayout.of([]).num_rows == 0


def test_logits_indices_are_each_requests_last_query_tokens() -> None:
    """Request 0 runs 1 + 2 tokens (its last token and two drafts), request 1 a 4-token prefill
    chunk that completes its prompt, request 2 1 + 3 tokens."""
    query_start_loc = np.array([0, 3, 7, 11])
    layout = DraftLayout.of([2, 0, 3])
    assert layout.logits_indices(query_start_loc[1:]).tolist() == [0, 1, 2, 6, 7, 8, 9, 10]


def test_negative_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="draft counts must be >= 0"):
        DraftLayout.of([1, -1])
