"""The frontend's half of `update_weights_from_tensors` (shared by `LLM` and `AsyncLLM`): the
caller's tensors become the utility calls that carry them (shoal/rl/tensor_transfer.py).

CPU tensors go in one call, every bucket's bytes in it. CUDA tensors go one bucket a call, each
packed into a buffer of the caller's that lives until its call has returned (so the caller
needs one bucket of spare memory, not a copy of the model); the batch is checked first, and
the engine holds scheduling from the first call to the last.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from shoal.rl.buckets import DEFAULT_BUCKET_BYTES, named_tensors_of
from shoal.rl.tensor_transfer import cpu_bucket, cuda_bucket, encode_metas, plan_tensor_buckets

NamedTensors = dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | torch.nn.Module


def named_tensor_list(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    named = named_tensors_of(named_tensors)
    if not named:
        raise ValueError("update_weights_from_tensors got no tensors")
    devices = {t.device for _, t in named if isinstance(t, torch.Tensor)}
    if len(devices) != 1 or not all(isinstance(t, torch.Tensor) for _, t in named):
        raise ValueError(f"update_weights_from_tensors needs tensors on one device, got {sorted(map(str, devices))}")
    return named


def needs_check_first(named: list[tuple[str, torch.Tensor]]) -> list[list[Any]] | None:
    """The metadata to check before the calls, where the update takes several (CUDA)."""
    return encode_metas(named) if named[0][1].is_cuda else None


def tensor_update_calls(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[list[dict[str, Any]], bool]]:
    """(buckets, final) of each call, in order; a CUDA bucket's buffer lives until the next."""
    buckets = plan_tensor_buckets(named, bucket_bytes)
    if not named[0][1].is_cuda:
        yield [cpu_bucket(bucket) for bucket in buckets], True
        return
    for i, bucket in enumerate(buckets):
        with cuda_bucket(bucket) as encoded:
            yield [encoded], i == len(buckets) - 1
