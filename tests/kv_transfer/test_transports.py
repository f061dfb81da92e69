"""KV transports and their errors (shoal/kv_transfer/transport.py, shm_transport.py, cuda_ipc.py):
blocks round-trip with their layout, a missing transfer times out, a transfer of another
geometry or a truncated one is refused, bad params are a ValueError."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from shoal import SamplingParams
from shoal.kv_transfer.layout import KVLayout, LayerLayout
from shoal.kv_transfer.params import KVTransferError, KVTransferTimeout
from shoal.kv_transfer.shm_transport import SharedMemoryTransport
from shoal.kv_transfer.transport import KVTransport, load_blocks, save_blocks

LAYOUT = KVLayout(
    layers=[LayerLayout(2, 2, 8), LayerLayout(1, 1, 24)], block_size=4, dtype="bfloat16", element_size=2
)  # a standard attention layer, then an MLA-like latent layer


def _caches(num_blocks: int, device: str = "cpu") -> list[torch.Tensor]:
    return [torch.randn(LAYOUT.block_shape(i, num_blocks), device=device).to(torch.bfloat16) for i in range(2)]


def _round_trip(transport: KVTransport, device: str) -> None:
    source, target = _caches(10, device), _caches(8, device)
    transfer_id = f"test-{uuid.uuid4().hex}"
    save_blocks(transport, transfer_id, LAYOUT, source, [7, 2, 5])
    load_blocks(transport, transfer_id, LAYOUT, target, first_block=1, block_ids=[0, 6], timeout_s=2.0)
    for src, dst in zip(source, target, strict=True):
        assert torch.equal(dst[:, 0], src[:, 2]) and torch.equal(dst[:, 6], src[:, 5])


def test_shared_memory_round_trip_and_release(tmp_path) -> None:
    transport = SharedMemoryTransport(str(tmp_path))
    _round_trip(transport, "cpu")
    assert not list(tmp_path.iterdir())  # the loader released it


def test_a_missing_transfer_times_out(tmp_path) -> None:
    transport = SharedMemoryTransport(str(tmp_path))
    start = time.monotonic()
    with pytest.raises(KVTransferTimeout, match=r"did not arrive within 0\.1 s"):
        transport.load("never-saved", LAYOUT, timeout_s=0.1)
    assert time.monotonic() - start < 1.0


def test_another_geometry_or_a_truncated_transfer_is_refused(tmp_path) -> None:
    transport = SharedMemoryTransport(str(tmp_path))
    transport.save("t1", LAYOUT, _caches(2))
    other = KVLayout(layers=LAYOUT.layers, block_size=8, dtype="bfloat16", element_size=2)
    with pytest.raises(KVTransferError, match="layouts differ"):
        transport.load("t1", other, timeout_s=1.0)
    path = transport.path("t1")
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(KVTransferError, match="truncated"):
        transport.load("t1", LAYOUT, timeout_s=1.0)
    with pytest.raises(KVTransferError, match="bad transfer id"):
        transport.load("../etc", LAYOUT, timeout_s=1.0)


def test_malformed_transfer_params_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="kv_transfer_params"):
        SamplingParams(extra_args={"kv_transfer_params": {"role": "fly"}})
    SamplingParams(extra_args={"other": 1})  # other keys are left to extensions


@pytest.mark.gpu
def test_cuda_ipc_round_trip_between_processes(tmp_path) -> None:
    """The decode side in another process opens the prefill side's handle."""
    import multiprocessing

    from shoal.kv_transfer.cuda_ipc import CudaIpcTransport

    transport = CudaIpcTransport(str(tmp_path))
    source = _caches(6, "cuda")
    save_blocks(transport, "ipc-1", LAYOUT, source, [4, 1])
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        checksum = pool.apply(_load_in_child, (str(tmp_path),))
    expected = sum(float(c[:, [4, 1]].float().sum()) for c in source)
    assert checksum == pytest.approx(expected, rel=1e-3)
    transport.save("ipc-2", LAYOUT, [c[:, :1] for c in source])  # sweeps the acknowledged one
    assert "ipc-1" not in transport._exported
    transport.close()


def _load_in_child(directory: str) -> float:
    from shoal.kv_transfer.cuda_ipc import CudaIpcTransport

    target = _caches(3, "cuda")
    load_blocks(CudaIpcTransport(directory), "ipc-1", LAYOUT, target, first_block=0, block_ids=[2, 0], timeout_s=5.0)
    return sum(float(c[:, [2, 0]].float().sum()) for c in target)


def test_make_transport_by_kind(tmp_path) -> None:
    from shoal.kv_transfer.transport import make_transport

    assert isinstance(make_transport(torch.device("cpu")), SharedMemoryTransport)
    with pytest.raises(ValueError, match="SHOAL_KV_TRANSPORT"):
        make_transport(torch.device("cpu"), "carrier-pigeon")


@pytest.mark.gpu
def test_nccl_pull_between_two_gpus(tmp_path) -> None:
    """The decode side (GPU 1, another process) pulls what the prefill side (GPU 0) saved."""
    import multiprocessing

    from shoal.kv_transfer.nccl_transport import NcclTransport

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    transport = NcclTransport(torch.device("cuda", 0), str(tmp_path))
    source = _caches(6, "cuda:0")
    save_blocks(transport, "nccl-1", LAYOUT, source, [4, 1])
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        checksum = pool.apply(_pull_in_child, (str(tmp_path),))
    assert checksum == pytest.approx(sum(float(c[:, [4, 1]].float().sum()) for c in source), rel=1e-3)
    with pytest.raises(KVTransferTimeout):
        NcclTransport(torch.device("cuda", 0), str(tmp_path)).load("nccl-missing", LAYOUT, timeout_s=0.2)
    transport.close()


def _pull_in_child(directory: str) -> float:
    from shoal.kv_transfer.nccl_transport import NcclTransport

    target = _caches(3, "cuda:1")
    transport = NcclTransport(torch.device("cuda", 1), directory)
    load_blocks(transport, "nccl-1", LAYOUT, target, first_block=0, block_ids=[2, 0], timeout_s=20.0)
    return sum(float(c[:, [2, 0]].float().sum()) for c in target)


def test_disaggregate_flag_parses_counts() -> None:
    from shoal.entrypoints.disaggregated.engine_pool import DisaggregationOptions

    options = DisaggregationOptions.parse("prefill=2,decode=3", transfer_timeout_s=5.0)
    assert (options.num_prefill, options.num_decode, options.transfer_timeout_s) == (2, 3, 5.0)
    for bad in ("prefill=1", "prefill=0,decode=1", "encode=1,decode=1", "prefill=x,decode=1"):
        with pytest.raises(ValueError, match="--disaggregate"):
            DisaggregationOptions.parse(bad)
