"""How much GPU memory the KV cache may take, counting this process's memory only.

The budget is `gpu_memory_utilization` × the device's total memory, minus what this process
holds: the peak torch allocated during a dummy forward of a full step (weights + activations +
sampler) and the memory outside torch's allocator (CUDA context, NCCL buffers, library
workspaces). Another process on the same GPU is not charged to us when NVML can tell processes
apart; without NVML, device-wide usage stands in for ours (and co-tenants count against us).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

# Left free beyond the budget for allocator fragmentation and CUDA-graph memory.
_SAFETY_MARGIN_BYTES = 256 << 20


def kv_cache_budget_bytes(device: torch.device, gpu_memory_utilization: float, peak_torch_bytes: int) -> int:
    free, total = torch.cuda.mem_get_info(device)
    non_torch = _non_torch_bytes(device, total - free)
    budget = int(gpu_memory_utilization * total) - peak_torch_bytes - non_torch
    # Never more than is actually free now (a co-tenant may hold more than our share).
    available = min(budget, free + torch.cuda.memory_reserved(device) - peak_torch_bytes - _SAFETY_MARGIN_BYTES)
    logger.info(
        "GPU memory: total %.1f GiB, utilization %.2f, torch peak %.2f GiB, outside torch %.2f GiB → KV cache %.2f GiB",
        total / 2**30,
        gpu_memory_utilization,
        peak_torch_bytes / 2**30,
        non_torch / 2**30,
        max(available, 0) / 2**30,
    )
    return max(available, 0)


def _non_torch_bytes(device: torch.device, device_used: int) -> int:
    reserved = torch.cuda.memory_reserved(device)
    ours = _nvml_process_bytes(device)
    used = ours if ours is not None else device_used
    return max(0, used - reserved)


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
