"""`DraftLayout`: where a step's draft tokens sit among the rows the target scores.

A request with n drafts runs n + 1 query tokens in the verification forward (its last emitted
token, then its n drafts) and gets n + 1 logits rows: row j scores draft j (j < n), row n is the
bonus position. Requests' rows follow one another in batch order, so request i's rows start at
`first_row[i]` = sum of (n + 1) over the requests before it; its drafts sit at
`first_draft[i]` = sum of n before it in the flattened draft arrays. A request with no drafts has
one row, as in a step without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DraftLayout:
    num_draft_tokens: np.ndarray  # [num_reqs] int64
    first_row: np.ndarray  # [num_reqs] each request's first logits row
    first_draft: np.ndarray  # [num_reqs] each request's first draft in the flattened drafts
    draft_req: np.ndarray  # [num_drafts] the request of each draft
    draft_pos: np.ndarray  # [num_drafts] its index among the request's drafts
    draft_rows: np.ndarray  # [num_drafts] the logits row that scores it

    @classmethod
    def of(cls, num_draft_tokens: np.ndarray | list[int]) -> DraftLayout:
        n = np.asarray(num_draft_tokens, dtype=np.int64).reshape(-1)
        if (n < 0).any():
            raise ValueError(f"draft counts must be >= 0, got {n.tolist()}")
        first_row = np.cumsum(n + 1) - (n + 1)
        first_draft = np.cumsum(n) - n
        draft_req = np.repeat(np.arange(len(n)), n)
        draft_pos = np.arange(int(n.sum())) - first_draft[draft_req]
        return cls(n, first_row, first_draft, draft_req, draft_pos, first_row[draft_req] + draft_pos)

    @property
    def num_reqs(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def num_drafts(self) -> int:
        return len(self.draft_req)

    @property
    def num_rows(self) -> int:
        return self.num_reqs + self.num_drafts

    @property
    def bonus_rows(self) -> np.ndarray:
        """[num_reqs] each request's last row (the position after its drafts)."""
        return self.first_row + self.num_draft_tokens

    @property
    def row_req(self) -> np.ndarray:
        """[num_rows] the request of each logits row."""
        return np.repeat(np.arange(self.num_reqs), self.num_draft_tokens + 1)

    def logits_indices(self, query_ends: np.ndarray) -> np.ndarray:
        """[num_rows] the rows of the forward's hidden states to compute logits for: each
        request's last n + 1 query tokens. `query_ends[i]`: one past request i's last query
        token in the flat batch (the runner's `query_start_loc[1:]` at the sampling requests)."""
        row_req = self.row_req
        offset_from_end = self.bonus_rows[row_req] - np.arange(self.num_rows)  # n - j for row j
        return np.asarray(query_ends)[row_req] - 1 - offset_from_end
