"""How much GPU memory the KV cache may take, counting this engine's own memory only.

`gpu_memory_utilization` is the engine's share of the device: the budget is that fraction of
the device's total memory, minus what this process holds: the peak torch allocated during a
dummy forward of a full step (weights + activations + sampler) and the memory outside torch's
allocator (CUDA context growth, NCCL buffers, library workspaces). What other processes hold (a
colocated trainer, another engine) is never charged to the engine's share, but it is not
available either: the budget never exceeds what is free now. This process's memory outside torch
is NVML's figure for it where NVML can tell processes apart, else what the device gained since
this worker started (`device_used_at_start_bytes`, measured in `Worker.init_device`), which
leaves out what others already held then.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

# Left free beyond the budget for allocator fragmentation and CUDA-graph memory.
_SAFETY_MARGIN_BYTES = 256 << 20


def device_used_bytes(device: torch.device) -> int:
    """Bytes in use on the device now, by every process (the driver's figure)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def kv_cache_budget_bytes(
    device: torch.device, gpu_memory_utilization: float, peak_torch_bytes: int, device_used_at_start_bytes: int = 0
) -> int:
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    process_bytes = _nvml_process_bytes(device)
    if process_bytes is None:  # what the device gained since start stands in for ours
        process_bytes = max(0, total - free - device_used_at_start_bytes)
    available = kv_cache_budget(total, free, reserved, peak_torch_bytes, process_bytes, gpu_memory_utilization)
    logger.info(
        "GPU memory: total %.1f GiB, utilization %.2f, others at start %.2f GiB, torch peak %.2f GiB, "
        "outside torch %.2f GiB → KV cache %.2f GiB",
        total / 2**30,
        gpu_memory_utilization,
        device_used_at_start_bytes / 2**30,
        peak_torch_bytes / 2**30,
        max(0, process_bytes - reserved) / 2**30,
        available / 2**30,
    )
    return available


def kv_cache_budget(
    total_bytes: int,
    free_bytes: int,
    reserved_bytes: int,
    peak_torch_bytes: int,
    process_bytes: int,
    gpu_memory_utilization: float,
) -> int:
    """The KV cache's bytes: the engine's share (`gpu_memory_utilization` of `total_bytes`) less
    its own peak torch memory and its memory outside torch (`process_bytes`, all this process
    holds on the device, less torch's `reserved_bytes`); never more than is free now (other
    processes' memory is not ours to take), with a safety margin."""
    non_torch = max(0, process_bytes - reserved_bytes)
    share = int(gpu_memory_utilization * total_bytes) - peak_torch_bytes - non_torch
    # Memory torch has reserved but not in use at the peak is ours to reuse.
    free_to_us = free_bytes + reserved_bytes - peak_torch_bytes - _SAFETY_MARGIN_BYTES
    if free_to_us < share:
        logger.warning(
            "other processes hold GPU memory the engine's share (gpu_memory_utilization %.2f) counts on: "
            "the KV cache gets %.2f GiB instead of %.2f GiB",
            gpu_memory_utilization,
            max(free_to_us, 0) / 2**30,
            share / 2**30,
        )
    return max(0, min(share, free_to_us))


def _nvml_process_bytes(device: torch.device) -> int | None:
    """This process's memory on the device according to NVML, if NVML can see it (in a
    container with its own PID namespace it cannot)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory:
                return int(process.usedGpuMemory)
    except Exception:  # NVML errors come in many types; fall back to device-wide numbers
        return None
    return None
