"""KV-cache sizing when a trainer shares the GPU: the engine's share is gpu_memory_utilization of
the device less the engine's own memory; other processes' memory is not charged to it, but it is
not taken either (the arithmetic of `kv_cache_budget`, which the GPU path feeds with the
driver's figures)."""

from __future__ import annotations

from shoal.workers.gpu_memory import _SAFETY_MARGIN_BYTES, kv_cache_budget

GIB = 1 << 30
TOTAL = 100 * GIB


def budget(free: int, reserved: int, peak: int, process: int, utilization: float) -> int:
    return kv_cache_budget(TOTAL, free, reserved, peak, process, utilization)


def test_alone_the_engine_gets_its_share_less_its_own_memory() -> None:
    # 20 GiB weights + activations at the peak, 1 GiB outside torch (CUDA context, NCCL).
    assert budget(free=79 * GIB, reserved=20 * GIB, peak=20 * GIB, process=21 * GIB, utilization=0.5) == 29 * GIB


def test_a_trainers_memory_is_not_charged_to_the_engines_share() -> None:
    # The same engine beside a trainer holding 30 GiB: the same 29 GiB (there is room for them).
    alone = budget(free=79 * GIB, reserved=20 * GIB, peak=20 * GIB, process=21 * GIB, utilization=0.5)
    shared = budget(free=49 * GIB, reserved=20 * GIB, peak=20 * GIB, process=21 * GIB, utilization=0.5)
    assert shared == alone


def test_memory_others_hold_is_not_taken() -> None:
    # A trainer holding 70 GiB leaves 9 GiB free: the engine's share (29 GiB) is capped by it.
    assert budget(free=9 * GIB, reserved=20 * GIB, peak=20 * GIB, process=21 * GIB, utilization=0.5) == (
        9 * GIB - _SAFETY_MARGIN_BYTES
    )


def test_nothing_left_is_zero() -> None:
    assert budget(free=GIB, reserved=60 * GIB, peak=60 * GIB, process=61 * GIB, utilization=0.5) == 0
