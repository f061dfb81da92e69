"""The sleep-memory allocator (csrc/sleep_memory.cu): a tag's physical memory goes back to the
driver and comes back at the same addresses, with its contents or zeroed, and a CUDA graph
captured over it replays correctly afterwards. On a machine without a GPU the allocator is not
available and sleep falls back to moving storages."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels import sleep_memory

MIB = 1 << 20


def test_without_a_gpu_the_allocator_is_unavailable_and_sleep_moves_storages(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.workers.sleep import MovedStorage, WorkerSleep

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not sleep_memory.available()
    with pytest.raises(RuntimeError, match="GPU"):
        sleep_memory.SleepMemoryPool(["weights"])
    assert isinstance(WorkerSleep._strategy(torch.device("cpu"), keep_addresses=True), MovedStorage)


@pytest.fixture(scope="module")
def pool() -> sleep_memory.SleepMemoryPool:
    if not sleep_memory.available():
        pytest.fail("the GPU tests need shoal's CUDA ops built (python -m shoal.kernels.build)")
    return sleep_memory.SleepMemoryPool(["a", "b"])


@pytest.mark.gpu
def test_release_gives_the_memory_to_the_driver_and_restore_brings_contents_back(
    pool: sleep_memory.SleepMemoryPool,
) -> None:
    with pool.allocating("a"):
        x = torch.randn(64 * MIB, device="cuda")  # 256 MiB
    with pool.allocating("b"):
        y = torch.full((32 * MIB,), 3.0, device="cuda")  # 128 MiB
    outside = torch.ones(MIB, device="cuda")  # torch's own allocator: untouched
    x_ref, x_ptr, y_ptr = x.clone(), x.data_ptr(), y.data_ptr()
    assert pool.mapped_bytes("a") >= x.nbytes and pool.mapped_bytes("b") >= y.nbytes
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]

    assert pool.release("a", keep_contents=True) >= x.nbytes
    assert pool.release("b", keep_contents=False) >= y.nbytes
    assert pool.mapped_bytes("a") == pool.mapped_bytes("b") == 0
    assert torch.cuda.mem_get_info()[0] - free_before >= x.nbytes + y.nbytes
    assert outside.sum().item() == MIB

    assert pool.restore("a") >= x.nbytes and pool.restore("b") >= y.nbytes
    assert (x.data_ptr(), y.data_ptr()) == (x_ptr, y_ptr)
    assert torch.equal(x, x_ref)
    assert not y.any()  # released without its contents: zeros
    assert torch.cuda.mem_get_info()[0] <= free_before + 16 * MIB


@pytest.mark.gpu
def test_a_cuda_graph_over_released_memory_replays_after_restore(pool: sleep_memory.SleepMemoryPool) -> None:
    with pool.allocating("a"):
        weight = torch.randn(1024, 1024, device="cuda")
    with pool.allocating("b"):
        cache = torch.randn(1024, 1024, device="cuda")
    inputs = torch.randn(8, 1024, device="cuda")
    # Once eagerly first: cuBLAS creates its handle and workspace on first use, which a capture
    # cannot do (run alone, this is the process's first matmul).
    inputs @ weight + cache[:8]
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = inputs @ weight + cache[:8]
    weight_ref = weight.clone()
    pool.release("a", keep_contents=True)
    pool.release("b", keep_contents=False)
    pool.restore("b")
    pool.restore("a")
    cache[:8] = 1.0  # new contents at the same address
    graph.replay()
    torch.testing.assert_close(out, inputs @ weight_ref + 1.0)
