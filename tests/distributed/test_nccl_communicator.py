"""The CuPy NCCL communicator on two GPUs (one process each): collectives, point-to-point, and an
all-reduce captured in a CUDA graph and replayed. Rank 0 makes the unique id, as the executor's
group leaders do, and hands it to rank 1."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _run_rank(rank: int, world_size: int, id_queue) -> None:
    from shoal.distributed.communicator import CupyNcclCommunicator, nccl_unique_id

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    if rank == 0:
        unique_id = nccl_unique_id()
        for _ in range(world_size - 1):
            id_queue.put(unique_id)
    else:
        unique_id = id_queue.get()
    comm = CupyNcclCommunicator(unique_id, rank, world_size, device)

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        reduced = comm.all_reduce(torch.full((4, 8), float(rank + 1), dtype=dtype, device=device))
        torch.testing.assert_close(reduced, torch.full((4, 8), 3.0, dtype=dtype, device=device))

    mine = torch.tensor([[rank, -rank]], device=device)
    assert comm.all_gather(mine, dim=-1).tolist() == [[0, 0, 1, -1]]
    assert comm.all_gather(mine, dim=0).tolist() == [[0, 0], [1, -1]]
    assert comm.broadcast(torch.tensor([float(rank)], device=device), 1).tolist() == [1.0]

    if rank == 0:
        comm.send(torch.arange(5.0, device=device), 1)
    else:
        assert comm.recv(torch.empty(5, device=device), 0).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]

    # Captured once, replayed on new input: the NCCL kernel runs on the capture stream.
    static = torch.zeros(16, device=device)
    comm.all_reduce(static)  # warm-up outside capture (NCCL sets up lazily)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.all_reduce(static)
    static.fill_(float(rank + 10))
    graph.replay()
    torch.cuda.synchronize()
    assert static.tolist() == [21.0] * 16
    del graph  # NCCL's destroy waits for the graphs that captured the communicator
    comm.destroy()


def test_cupy_nccl_communicator_on_two_gpus() -> None:
    pytest.importorskip("cupy")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    context = torch.multiprocessing.get_context("spawn")
    id_queue = context.SimpleQueue()
    torch.multiprocessing.start_processes(_run_rank, args=(2, id_queue), nprocs=2, start_method="spawn")
