"""Rank layout of the tensor- and pipeline-parallel groups (no processes needed)."""

from __future__ import annotations

import pytest

from shoal.distributed.parallel_state import pp_group_ranks, pp_layer_range, tp_group_ranks


def test_tp_groups_are_consecutive_ranks_of_one_stage() -> None:
    assert tp_group_ranks(tp_size=2, pp_size=2) == [[0, 1], [2, 3]]
    assert tp_group_ranks(tp_size=4, pp_size=1) == [[0, 1, 2, 3]]
    assert tp_group_ranks(tp_size=1, pp_size=3) == [[0], [1], [2]]


def test_pp_groups_take_one_tp_rank_from_each_stage() -> None:
    assert pp_group_ranks(tp_size=2, pp_size=2) == [[0, 2], [1, 3]]
    assert pp_group_ranks(tp_size=1, pp_size=3) == [[0, 1, 2]]
    assert pp_group_ranks(tp_size=4, pp_size=1) == [[0], [1], [2], [3]]


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2), (2, 3), (4, 2)])
def test_every_rank_is_in_exactly_one_group_of_each_kind(tp: int, pp: int) -> None:
    for groups in (tp_group_ranks(tp, pp), pp_group_ranks(tp, pp)):
        assert sorted(r for g in groups for r in g) == list(range(tp * pp))
    for rank in range(tp * pp):
        (tp_group,) = [g for g in tp_group_ranks(tp, pp) if rank in g]
        (pp_group,) = [g for g in pp_group_ranks(tp, pp) if rank in g]
        # rank = pp_rank * tp + tp_rank: position in the TP group is tp_rank, in the PP group pp_rank.
        assert tp_group.index(rank) == rank % tp
        assert pp_group.index(rank) == rank // tp


def test_pipeline_layer_partition() -> None:
    assert [pp_layer_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [pp_layer_range(3, r, 3) for r in range(3)] == [(0, 1), (1, 2), (2, 3)]
    assert [pp_layer_range(5, r, 2, (1, 4)) for r in range(2)] == [(0, 1), (1, 5)]
