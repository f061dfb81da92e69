"""The proposer interface through its n-gram implementation, as the runner will call it."""

from __future__ import annotations

import numpy as np

from shoal.spec_decode.config import SpeculativeConfig
from shoal.spec_decode.ngram import NgramProposer
from shoal.spec_decode.proposer import ProposerInputs, make_proposer


def input_batch_rows(rows: dict[int, list[int]], max_num_reqs: int = 8, max_model_len: int = 32) -> np.ndarray:
    token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
    for slot, row in rows.items():
        token_ids[slot, : len(row)] = row
    return token_ids


def test_ngram_proposer_drafts_from_each_requests_row() -> None:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    proposer = make_proposer(config)
    assert isinstance(proposer, NgramProposer) and not proposer.uses_target_hidden_states
    assert proposer.kv_cache_block_bytes() == 0
    rows = {
        5: [10, 11, 12, 13, 14, 10, 11],  # "10 11" seen at the start: propose 12 13 14
        2: [1, 2, 3, 4],  # nothing repeats
        0: [7, 8, 9, 7, 8],  # "7 8" then 9, 7, 8 (the row's own end)
    }
    inputs = ProposerInputs(
        req_ids=["a", "b", "c"],
        slots=np.array([5, 2, 0]),
        token_ids=input_batch_rows(rows),
        num_tokens=np.array([7, 4, 5]),
    )
    drafts = proposer.propose(inputs)
    assert drafts.as_lists() == [[12, 13, 14], [], [9, 7, 8]]
    assert drafts.token_ids.shape == (3, 3) and drafts.probs is None
    capped = proposer.propose(ProposerInputs(**{**inputs.__dict__, "max_num_drafts": np.array([1, 3, 0])}))
    assert capped.as_lists() == [[12], [], []]  # request c's speculation off


def test_every_method_has_a_proposer(tmp_path) -> None:
    from shoal.spec_decode.draft_model import DraftModelProposer
    from shoal.spec_decode.eagle import Eagle3Proposer, EagleProposer
    from shoal.spec_decode.mtp import MtpProposer

    (tmp_path / "config.json").write_text("{}")
    expected = {"draft_model": DraftModelProposer, "eagle": EagleProposer, "eagle3": Eagle3Proposer, "mtp": MtpProposer}
    for method, cls in expected.items():
        proposer = make_proposer(SpeculativeConfig(method=method, num_speculative_tokens=2, model=str(tmp_path)))
        assert type(proposer) is cls and proposer.method == method
