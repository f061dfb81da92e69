"""N-gram prompt lookup against a plain reference (the rule written out row by row) on random
rows, and on hand cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.spec_decode import ngram
from shoal.spec_decode.ngram import propose_ngram_drafts


def reference_drafts(row: list[int], k: int, min_n: int, max_n: int, max_model_len: int, cap: int) -> list[int]:
    """The longest n in [min_n, max_n] whose last-n tokens occur earlier (start < len - n), its
    earliest occurrence, the tokens after it: up to k, to the row's end, before max_model_len."""
    length = len(row)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = row[length - n :]
        for start in range(length - n):
            if row[start : start + n] == suffix:
                limit = min(k, cap, max_model_len - length)
                return row[start + n : start + n + limit] if limit > 0 else []
    return []


def check_against_reference(
    rows: list[list[int]], k: int, min_n: int, max_n: int, max_model_len: int, caps: list[int] | None = None
) -> None:
    # The rows sit in scattered slots of a larger array whose other cells hold junk.
    rng = np.random.default_rng(len(rows))
    slots = rng.permutation(len(rows) + 3)[: len(rows)]
    token_ids = rng.integers(0, 7, size=(len(rows) + 3, max_model_len))
    for slot, row in zip(slots, rows):
        token_ids[slot, : len(row)] = row
    lengths = np.array([len(r) for r in rows])
    drafts, counts = propose_ngram_drafts(
        token_ids, slots, lengths, k, min_n, max_n, None if caps is None else np.array(caps)
    )
    assert drafts.shape == (len(rows), k)
    for i, row in enumerate(rows):
        expected = reference_drafts(row, k, min_n, max_n, max_model_len, k if caps is None else caps[i])
        assert counts[i] == len(expected), (row, expected, drafts[i])
        assert drafts[i, : counts[i]].tolist() == expected
        assert (drafts[i, counts[i] :] == -1).all()


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=40), min_size=1, max_size=8),
    k=st.integers(1, 6),
    window=st.tuples(st.integers(1, 4), st.integers(0, 3)),
)
def test_matches_the_reference_on_random_rows(rows: list[list[int]], k: int, window: tuple[int, int]) -> None:
    min_n, extra = window
    check_against_reference(rows, k, min_n, min_n + extra, max_model_len=48)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=30), min_size=1, max_size=6),
    caps=st.lists(st.integers(0, 5), min_size=6, max_size=6),
)
def test_rows_near_max_model_len_and_caller_caps(rows: list[list[int]], caps: list[int]) -> None:
    """max_model_len just above the rows (drafts cut before it), and the caller's per-row caps."""
    check_against_reference(rows, 4, 1, 3, max_model_len=32, caps=caps[: len(rows)])


def test_small_chunks_give_the_same_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 4, size=int(n)).tolist() for n in rng.integers(2, 200, size=40)]
    monkeypatch.setattr(ngram, "CHUNK_TOKENS", 300)  # a few rows a chunk, one row for the longest
    check_against_reference(rows, 5, 2, 4, max_model_len=256)


def propose(row: list[int], k: int = 4, min_n: int = 1, max_n: int = 3, width: int = 64) -> list[int]:
    token_ids = np.zeros((1, width), dtype=np.int64)
    token_ids[0, : len(row)] = row
    drafts, counts = propose_ngram_drafts(token_ids, np.array([0]), np.array([len(row)]), k, min_n, max_n)
    return drafts[0, : counts[0]].tolist()


def test_hand_cases() -> None:
    # vLLM's docstring example: [4, 2, 3] has no earlier match, [2, 3] does; 3 tokens follow it.
    assert propose([1, 2, 3, 4, 2, 3], min_n=2, max_n=3) == [4, 2, 3]
    # The longest n wins over an earlier shorter match: "7 8 9" matches at 4, "9" alone at 0.
    assert propose([9, 5, 5, 5, 7, 8, 9, 1, 2, 7, 8, 9]) == [1, 2, 7, 8]
    # Among the longest matches, the earliest: [5, 6] at 0 (then 1, 2) and at 4 (then 3, 4).
    assert propose([5, 6, 1, 2, 5, 6, 3, 4, 5, 6], min_n=2, max_n=2) == [1, 2, 5, 6]
    # An occurrence may overlap the suffix: a run of one token proposes more of it.
    assert propose([4, 4, 4, 4], min_n=2, max_n=2) == [4, 4]
    # No n-gram of at least min_n repeats: no drafts; a single token: none.
    assert propose([1, 2, 3, 1, 5], min_n=2) == []
    assert propose([7]) == []
    # Drafts stop before max_model_len (the array's width).
    assert propose([1, 2, 3, 1, 2], width=6) == [3]


def test_empty_batch_and_unused_rows() -> None:
    token_ids = np.zeros((4, 16), dtype=np.int64)
    drafts, counts = propose_ngram_drafts(token_ids, np.array([], dtype=np.int64), np.array([]), 3, 1, 2)
    assert drafts.shape == (0, 3) and counts.shape == (0,)
