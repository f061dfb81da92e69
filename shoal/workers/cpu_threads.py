"""How many intra-op threads torch gets on a CPU worker.

torch's default is one per physical core. That is the fastest on an idle machine, and the
slowest by far on a busy one: every op waits at a barrier for its slowest thread, and a thread
that shares its core with another process (the frontend's tokenizer and HTTP server, a
neighbour's job) arrives a whole scheduler slice late. On 2 cores, one busy neighbour made a
32-token request of the demo model many times slower with 2 threads than with 1
(BENCHMARKS.md, "CPU threads"). So an engine-core worker takes the physical cores it may run
on less one, which it leaves to the frontend process and whatever else the machine runs; at
least one. `SHOAL_CPU_THREADS` overrides it (Ray CPU workers, which each hold one CPU, get 1).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def default_cpu_threads() -> int:
    """The physical cores this process may use, less one (at least one)."""
    return max(1, usable_physical_cores() - 1)


def usable_physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (its affinity), capped by a cgroup
    CPU quota (a container limited to 4 CPUs of a 64-core host has 4)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = {_core_of(cpu) for cpu in cpus}  # hyperthreads of one core count once
    quota = cgroup_cpu_quota()
    return max(1, min(len(cores), math.ceil(quota)) if quota is not None else len(cores))


def _core_of(cpu: int) -> tuple[str, str] | int:
    """The (package, core) a logical CPU belongs to (Linux sysfs); the CPU itself elsewhere."""
    topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return (topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()
    except OSError:
        return cpu


def cgroup_cpu_quota(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> float | None:
    """CPUs' worth of time a cgroup v2 quota allows ("max": none, None)."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)
