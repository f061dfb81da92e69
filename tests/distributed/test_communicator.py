"""The gloo communicator behind the tensor- and pipeline-parallel groups, on four CPU ranks laid
out as TP=2 x PP=2 (Ray tasks of the session's cluster, one per rank, all running at once)."""

from __future__ import annotations

import types

import pytest
import torch

from shoal.distributed import communicator
from tests.ray_nodes import free_ports


def test_tp_and_pp_groups_over_gloo(ray_cluster: dict) -> None:
    import ray

    def run_rank(rank: int, world_size: int, init_method: str) -> dict:
        # Defined here so that Ray ships it by value (the test module is not importable there).
        import torch

        from shoal.distributed import parallel_state as ps

        ps.init_distributed_environment(world_size, rank, init_method)
        try:
            ps.initialize_model_parallel(2, 2, torch.device("cpu"))
            tp, pp = ps.get_tp_group(), ps.get_pp_group()
            result = {
                "tp_ranks": tp.ranks,
                "pp_ranks": pp.ranks,
                "all_reduce": tp.all_reduce(torch.full((2, 3), float(rank))).tolist(),
                "all_gather_last": tp.all_gather(torch.tensor([[rank, -rank]]), dim=-1).tolist(),
                "all_gather_first": tp.all_gather(torch.tensor([[rank, -rank]]), dim=0).tolist(),
                "broadcast": tp.broadcast(torch.tensor([float(rank)]), 1).tolist(),
            }
            if pp.is_first_rank:
                pp.send(torch.arange(3.0) + 10 * rank, pp.rank_in_group + 1)
            else:
                result["received"] = pp.recv(torch.empty(3), pp.rank_in_group - 1).tolist()
            return result
        finally:
            ps.destroy_model_parallel()

    task = ray.remote(num_cpus=1)(run_rank)
    init_method = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    results = ray.get([task.remote(rank, 4, init_method) for rank in range(4)], timeout=120)

    assert [r["tp_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert results[0]["all_reduce"] == [[1.0] * 3] * 2  # ranks 0 + 1
    assert results[3]["all_reduce"] == [[5.0] * 3] * 2  # ranks 2 + 3
    assert results[2]["all_gather_last"] == [[2, -2, 3, -3]]
    assert results[2]["all_gather_first"] == [[2, -2], [3, -3]]
    assert [r["broadcast"] for r in results] == [[1.0], [1.0], [3.0], [3.0]]
    assert results[2]["received"] == [0.0, 1.0, 2.0]
    assert results[3]["received"] == [10.0, 11.0, 12.0]


def test_nccl_backend_imports_without_cupy() -> None:
    """The GPU backend is import-safe on CPU: CuPy is imported only when a communicator is made."""
    assert issubclass(communicator.CupyNcclCommunicator, communicator.Communicator)
    fake_nccl = types.SimpleNamespace(NCCL_FLOAT32=7, NCCL_FLOAT16=6, NCCL_INT64=4)
    assert communicator._nccl_dtype(fake_nccl, torch.float32) == 7
    assert communicator._nccl_dtype(fake_nccl, torch.bfloat16) == 9  # NCCL's number; CuPy has no constant
    with pytest.raises(TypeError):
        communicator._nccl_dtype(fake_nccl, torch.complex64)


def test_concat_gathered_matches_a_full_tensor() -> None:
    full = torch.arange(24.0).reshape(2, 3, 4)
    for dim in (0, 1, -1):
        assert torch.equal(communicator.concat_gathered(list(full.chunk(2, dim=dim)), dim), full)
