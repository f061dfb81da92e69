"""Which decode batch sizes get a CUDA graph (the graphs themselves run in tests/gpu)."""

from __future__ import annotations

from shoal.workers.cuda_graphs import MAX_CAPTURE_SIZE, capture_sizes


def test_small_limits_are_captured_up_to_the_limit() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35  # steps of 8


def test_large_limits_stop_at_the_largest_captured_size() -> None:
    sizes = capture_sizes(1024)
    assert sizes[-1] == MAX_CAPTURE_SIZE == 512
    assert sizes[34:37] == [256, 272, 288]  # steps of 16 past 256
    assert capture_sizes(300)[-3:] == [272, 288, 300]
    assert sizes == sorted(set(sizes))
