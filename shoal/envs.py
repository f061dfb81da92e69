"""Every environment variable shoal reads, read once here at import, typed.

Nothing else in shoal calls `os.environ`; the Ray executor forwards the variables named in
`FORWARDED_PREFIXES` to every worker through the actors' runtime_env.
"""

from __future__ import annotations

import os
from pathlib import Path


def _str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def _bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


# Where the converted demo model and built artefacts are cached.
SHOAL_CACHE_DIR: str = _str(
    "SHOAL_CACHE_DIR", str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shoal")
)
# Logging level of the `shoal` logger.
SHOAL_LOGGING_LEVEL: str = _str("SHOAL_LOGGING_LEVEL", "INFO")
# Threads torch may use on CPU workers (0: the physical cores less one, see
# shoal/workers/cpu_threads.py; Ray CPU workers get 1 each).
SHOAL_CPU_THREADS: int = _int("SHOAL_CPU_THREADS", 0)
# Disable loading the compiled csrc library even where it is built.
SHOAL_DISABLE_CSRC: bool = _bool("SHOAL_DISABLE_CSRC", False)
# Sample plain temperature batches with the one-pass Gumbel-max kernel on CUDA
# (shoal/kernels/gumbel_sample.py; 0 keeps the general path, e.g. to compare the two).
SHOAL_FUSED_SAMPLING: bool = _bool("SHOAL_FUSED_SAMPLING", True)
# Fresh prompts' attention on CUDA in half precision (shoal/kernels/fresh_prefill_attention.py):
# "paged" (the unified paged kernel, like every other prefill chunk), "flash" (PyTorch's flash or
# memory-efficient SDPA backends on the step's keys and values) or "sdpa" (whichever backend SDPA
# picks). Paged is the default: on the nano-vllm protocol's ragged prompts the per-prompt SDPA
# calls lose (BENCHMARKS.md, "Fresh prompts through SDPA").
SHOAL_FRESH_PREFILL_ATTENTION: str = _str("SHOAL_FRESH_PREFILL_ATTENTION", "paged")
# Where `LLM.start_profile()` writes its traces when given no directory (vLLM: VLLM_TORCH_PROFILER_DIR).
SHOAL_TORCH_PROFILER_DIR: str | None = os.environ.get("SHOAL_TORCH_PROFILER_DIR") or None

# The Ray cluster to join (Ray's own variable), when no ray_address is given.
RAY_ADDRESS: str | None = os.environ.get("RAY_ADDRESS") or None
# The GPUs this process may use; in a worker actor, what Ray assigned to it (read-only for shoal).
CUDA_VISIBLE_DEVICES: str | None = os.environ.get("CUDA_VISIBLE_DEVICES")

# Variables forwarded to every worker process (Ray runtime_env), by prefix.
FORWARDED_PREFIXES: tuple[str, ...] = ("SHOAL_", "NCCL_", "GLOO_", "HF_", "TORCH_", "OMP_")


def forwarded_environment() -> dict[str, str]:
    """The subset of this process's environment that workers on any node must see."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}


# Where a CPU prefill engine leaves the KV of a request for a decode engine on the same node
# (shoal/kv_transfer/shm_transport.py): shared memory where the system has it.
SHOAL_KV_TRANSFER_DIR: str = _str(
    "SHOAL_KV_TRANSFER_DIR", "/dev/shm/shoal-kv" if os.path.isdir("/dev/shm") else "/tmp/shoal-kv"
)
# The KV transport of prefill/decode disaggregation: shm, cuda_ipc or nccl (empty: CUDA IPC on
# GPU, shared memory on CPU; shoal/kv_transfer/transport.py).
SHOAL_KV_TRANSPORT: str = _str("SHOAL_KV_TRANSPORT", "")
