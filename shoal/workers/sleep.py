"""Sleep and wake-up on a worker: give the device memory of the weights and the KV cache back,
and get it again (`Worker.sleep` / `Worker.wake_up`; the engine's side is in
engine_core/generation_control.py).

Level 1 keeps the weights' contents in pinned host memory; level 2 discards them (an update
brings new ones). The KV cache is always discarded (the scheduler has preempted every request
and forgotten the prefix cache) and comes back zeroed. Two ways to do it:

- `MovedStorage` (every device: the CPU path, and the GPU one without `enable_sleep_mode`): the
  tensors keep their objects, so every layer's reference stays valid, but their storages are
  emptied (`resize_(0)`: the memory goes back to the allocator, and on a GPU through
  `empty_cache` to the driver) and refilled on wake-up. Refilled storages have new addresses,
  which the decode CUDA graphs baked in: the graphs are dropped at sleep and captured again once
  everything is back. On a CPU the weights already live in host memory: level 1 leaves them
  there, level 2 empties their storages.
- `KeptAddresses` (a GPU with `enable_sleep_mode` and shoal's CUDA ops built): the weights and
  the KV cache were allocated from memory pools whose physical memory can be unmapped while
  their virtual addresses stay reserved (the CUDA VMM API, shoal/kernels/sleep_memory.py);
  wake-up maps new memory at the same addresses, and the CUDA graphs replay as captured.

Tensors asleep have no memory behind them (reading one crashes the process, or on a GPU the
device): nothing may touch them until wake-up. The scheduler schedules no step meanwhile;
anything else that would write the weights (an update) first calls `require_awake`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from shoal.workers.model_runner import ModelRunner

logger = logging.getLogger(__name__)

WEIGHTS, KV_CACHE = "weights", "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)


class SleepStrategy(Protocol):
    keeps_addresses: bool

    def allocating(self, tag: str) -> contextlib.AbstractContextManager[None]:
        """Where the memory of `tag` is allocated (the model load, the KV-cache allocation)."""
        ...

    def release_weights(self, model: torch.nn.Module, keep_contents: bool) -> int: ...

    def release_kv_cache(self, kv_caches: list[torch.Tensor]) -> int: ...

    def restore_weights(self) -> None: ...

    def restore_kv_cache(self) -> None: ...


class WorkerSleep:
    """Which of a worker's tags are asleep, and the strategy that frees and restores them."""

    def __init__(self, runner: ModelRunner, keep_addresses: bool) -> None:
        self.runner = runner
        self.strategy: SleepStrategy = self._strategy(runner.device, keep_addresses)
        self.asleep: set[str] = set()

    @staticmethod
    def _strategy(device: torch.device, keep_addresses: bool) -> SleepStrategy:
        if keep_addresses and device.type == "cuda":
            from shoal.kernels import sleep_memory

            if sleep_memory.available():
                return KeptAddresses()
            logger.warning("enable_sleep_mode: shoal's CUDA ops are not built; sleep will recapture CUDA graphs")
        return MovedStorage(device)

    def allocating(self, tag: str) -> contextlib.AbstractContextManager[None]:
        return self.strategy.allocating(tag)

    def sleep(self, level: int) -> int:
        """Free what is awake (parts already asleep stay as they are); returns the bytes freed."""
        runner = self.runner
        freed = 0
        if WEIGHTS not in self.asleep:
            freed += self.strategy.release_weights(self._weights(), keep_contents=level == 1)
            self.asleep.add(WEIGHTS)
        if KV_CACHE not in self.asleep:
            freed += self.strategy.release_kv_cache(runner.kv_caches)
            self.asleep.add(KV_CACHE)
        if not self.strategy.keeps_addresses:
            runner.drop_cuda_graphs()
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
            torch.cuda.empty_cache()  # what was freed (and cached activations) back to the driver
        return freed

    def wake_up(self, tags: Iterable[str]) -> None:
        """Restore the tags asked for that are asleep; once all are back, capture the CUDA
        graphs again if the addresses moved."""
        for tag in tags:
            if tag not in self.asleep:
                continue
            if tag == WEIGHTS:
                self.strategy.restore_weights()
            else:
                self.strategy.restore_kv_cache()
            self.asleep.discard(tag)
        if not self.asleep and not self.strategy.keeps_addresses:
            self.runner.capture_cuda_graphs()

    def _model(self) -> torch.nn.Module:
        if self.runner.model is None:
            raise RuntimeError("the model is not loaded")
        return self.runner.model

    def _weights(self) -> torch.nn.Module:
        """The modules whose weights sleep frees: the model, and a speculative drafter's own."""
        speculation = self.runner.speculation
        drafter = speculation.drafter_module if speculation is not None else None
        return self._model() if drafter is None else torch.nn.ModuleList([self._model(), drafter])

    def require_awake(self, tag: str) -> None:
        """Raise ValueError if `tag` is asleep (its tensors have no memory behind them)."""
        if tag in self.asleep:
            raise ValueError(f"the {tag} are asleep: call wake_up(tags=[{tag!r}]) first")

    def resident_bytes(self) -> dict[str, int]:
        """Bytes the parameters and the KV cache hold in their storages now (what a sleep
        frees: the storages of `MovedStorage`, or with `KeptAddresses` the mapped memory)."""
        if isinstance(self.strategy, KeptAddresses):
            return self.strategy.mapped_bytes()
        return {
            WEIGHTS: sum(s.nbytes() for s in unique_storages(self._weights().parameters())),
            KV_CACHE: sum(s.nbytes() for s in unique_storages(self.runner.kv_caches)),
        }


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages behind `tensors`, each once (views and tied weights share one)."""
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages.setdefault(storage.data_ptr(), storage)
    return list(storages.values())


class MovedStorage:
    """Empty the storages at sleep and refill them at wake-up (new addresses)."""

    keeps_addresses = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Per tag: (storage, its size, its contents in pinned host memory or None).
        self._released: dict[str, list[tuple[torch.UntypedStorage, int, torch.UntypedStorage | None]]] = {}

    def allocating(self, tag: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def release_weights(self, model: torch.nn.Module, keep_contents: bool) -> int:
        # Buffers (rotary tables) are small and not in any checkpoint: they stay.
        if keep_contents and self.device.type == "cpu":
            self._released[WEIGHTS] = []  # already in host memory
            return 0
        return self._release(WEIGHTS, unique_storages(model.parameters()), keep_contents)

    def release_kv_cache(self, kv_caches: list[torch.Tensor]) -> int:
        return self._release(KV_CACHE, unique_storages(kv_caches), keep_contents=False)

    def restore_weights(self) -> None:
        self._restore(WEIGHTS)

    def restore_kv_cache(self) -> None:
        self._restore(KV_CACHE)

    def _release(self, tag: str, storages: list[torch.UntypedStorage], keep_contents: bool) -> int:
        copies = [self._host_copy(s) if keep_contents else None for s in storages]
        if keep_contents and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies are done before the memory goes
        self._released[tag] = [(s, s.nbytes(), copy) for s, copy in zip(storages, copies)]
        for storage in storages:
            storage.resize_(0)
        return sum(nbytes for _, nbytes, _ in self._released[tag])

    @staticmethod
    def _host_copy(storage: torch.UntypedStorage) -> torch.UntypedStorage:
        # Pinned, so that the copies run at full speed (torch keeps freed pinned blocks for reuse).
        copy = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True).untyped_storage()
        copy.copy_(storage, non_blocking=True)
        return copy

    def _restore(self, tag: str) -> None:
        for storage, nbytes, copy in self._released.pop(tag, []):
            storage.resize_(nbytes)
            if copy is not None:
                storage.copy_(copy, non_blocking=True)
            else:
                storage.fill_(0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the host copies may go once this returns


class KeptAddresses:
    """Unmap the pools' physical memory at sleep and map new memory at the same addresses."""

    keeps_addresses = True

    def __init__(self) -> None:
        from shoal.kernels.sleep_memory import SleepMemoryPool

        self.pool = SleepMemoryPool(TAGS)
        # Level 2 unmaps the weights' pool without a copy; its buffers (rotary tables, in no
        # checkpoint) are kept here meanwhile.
        self._saved_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def allocating(self, tag: str) -> contextlib.AbstractContextManager[None]:
        return self.pool.allocating(tag)

    def release_weights(self, model: torch.nn.Module, keep_contents: bool) -> int:
        if not keep_contents:
            self._saved_buffers = [(b, b.to("cpu")) for b in model.buffers()]
        return self.pool.release(WEIGHTS, keep_contents)

    def release_kv_cache(self, kv_caches: list[torch.Tensor]) -> int:
        return self.pool.release(KV_CACHE, keep_contents=False)

    def restore_weights(self) -> None:
        self.pool.restore(WEIGHTS)
        with torch.no_grad():
            for buffer, saved in self._saved_buffers:
                buffer.copy_(saved)
        self._saved_buffers = []

    def restore_kv_cache(self) -> None:
        self.pool.restore(KV_CACHE)

    def mapped_bytes(self) -> dict[str, int]:
        return {tag: self.pool.mapped_bytes(tag) for tag in TAGS}
