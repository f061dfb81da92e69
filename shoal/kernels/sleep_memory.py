"""Device memory that can give its physical pages back while keeping its addresses: the
allocator behind `enable_sleep_mode` (csrc/sleep_memory.cu, ops `torch.ops.shoal.sleep_memory_*`).

The allocator reserves each allocation's virtual addresses and maps physical memory under them
with the CUDA VMM API (cuMemAddressReserve, cuMemCreate, cuMemMap). `release(tag)` copies the
contents of every allocation made under `tag` to pinned host memory if asked, then unmaps and
frees the physical memory (the driver has it back at once); `restore(tag)` creates and maps
new physical memory at the same addresses and copies the contents back (or zeroes it). Tensors,
kernels and captured CUDA graphs that hold those addresses work as before.

torch routes allocations to it through a `MemPool` per tag, only inside `allocating(tag)` (the
model load, the KV-cache allocation); everything else stays with torch's caching allocator.
Each pool has its own segments, so no tensor of one tag lands in memory of another.

The host copy of an allocation stays allocated after `restore`, so that a later level-1 sleep
does not pin memory again (pinning gigabytes takes seconds); a release without contents (level
2, the KV cache) frees it.

There is no pure-torch reference of an allocator: where the library is not built (and on CPU),
sleep frees storages instead and CUDA graphs are captured again (`MovedStorage` in
shoal/workers/sleep.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence

import torch

from shoal.kernels import _C

logger = logging.getLogger(__name__)

# The allocator's entry points in the library, as torch's pluggable allocator looks them up.
MALLOC_SYMBOL, FREE_SYMBOL = "shoal_sleep_malloc", "shoal_sleep_free"
# The library's registry is one per process: every pool's tags get ids of their own, so that
# two engines in one process never release each other's memory. 0 marks allocations made
# outside `allocating`.
_TAG_IDS = itertools.count(1)


def available() -> bool:
    """Whether this process can use the allocator (a GPU and the built library)."""
    return torch.cuda.is_available() and _C.load() and hasattr(torch.ops.shoal, "sleep_memory_release")


class SleepMemoryPool:
    """One memory pool per tag over the VMM allocator, and the release / restore of a tag."""

    def __init__(self, tags: Sequence[str]) -> None:
        if not available():
            raise RuntimeError("the sleep-memory allocator needs a GPU and shoal's CUDA ops (make kernels)")
        allocator = torch.cuda.memory.CUDAPluggableAllocator(str(_C.library_path()), MALLOC_SYMBOL, FREE_SYMBOL)
        self._allocator = allocator  # the pools refer to it: keep it alive as long as they live
        self._ids = {tag: next(_TAG_IDS) for tag in tags}
        self._pools = {tag: torch.cuda.MemPool(allocator.allocator()) for tag in tags}

    @contextlib.contextmanager
    def allocating(self, tag: str) -> Iterator[None]:
        """Allocations of this thread on the current device come from `tag`'s pool."""
        torch.ops.shoal.sleep_memory_set_tag(self._ids[tag])
        try:
            with torch.cuda.use_mem_pool(self._pools[tag]):
                yield
        finally:
            torch.ops.shoal.sleep_memory_set_tag(0)

    def release(self, tag: str, keep_contents: bool) -> int:
        """Unmap the physical memory of `tag`'s allocations (copied to pinned host memory first
        with `keep_contents`); returns the bytes given back to the driver."""
        return int(torch.ops.shoal.sleep_memory_release(self._ids[tag], keep_contents))

    def restore(self, tag: str) -> int:
        """Map new physical memory under `tag`'s released allocations, with their contents
        copied back (zeros where none were kept); returns the bytes mapped."""
        return int(torch.ops.shoal.sleep_memory_restore(self._ids[tag]))

    def mapped_bytes(self, tag: str) -> int:
        """Bytes of `tag`'s allocations that have physical memory now."""
        return int(torch.ops.shoal.sleep_memory_mapped_bytes(self._ids[tag]))
