"""The frontend's half of `update_weights_from_tensors` (the verb's `frontend` plan in
shoal/rl_verbs.py, run by `LLM` and `AsyncLLM` alike): the caller's tensors become the utility
calls that carry them (shoal/rl/tensor_transfer.py).

CPU tensors go in one call, every bucket's bytes in it. CUDA tensors go one bucket a call, each
packed into a buffer of the caller's that lives until its call has returned (so the caller
needs one bucket of spare memory, not a copy of the model); the batch is checked first, and
the engine holds scheduling from the first call to the last.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from typing import Any

import torch

from shoal.rl.buckets import named_tensors_of
from shoal.rl.tensor_transfer import cpu_bucket, cuda_bucket, encode_metas, plan_tensor_buckets
from shoal.rl_verbs import DEFAULT_BUCKET_BYTES

NamedTensors = dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | torch.nn.Module


def tensor_update_calls(
    named_tensors: NamedTensors,
    weight_version: str | None = None,
    reset_prefix_cache: bool = True,
    bucket_bytes: int | None = None,
) -> Generator[tuple[str, tuple[Any, ...]], Any, str]:
    """The engine-core calls of `update_weights_from_tensors`, in order: (method, args), each
    call's result sent back in; returns the new weight version. A CUDA bucket's buffer lives
    until its call has returned."""
    named = named_tensor_list(named_tensors)
    if named[0][1].is_cuda:  # several calls: the whole batch is checked before the first
        yield "check_weights", (encode_metas(named),)
    version = ""
    for buckets, final in _bucket_calls(named, bucket_bytes or DEFAULT_BUCKET_BYTES):
        version = yield "update_weights_from_tensors", (buckets, weight_version, reset_prefix_cache, final)
    return version


def named_tensor_list(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    named = named_tensors_of(named_tensors)
    if not named:
        raise ValueError("update_weights_from_tensors got no tensors")
    devices = {t.device for _, t in named if isinstance(t, torch.Tensor)}
    if len(devices) != 1 or not all(isinstance(t, torch.Tensor) for _, t in named):
        raise ValueError(f"update_weights_from_tensors needs tensors on one device, got {sorted(map(str, devices))}")
    return named


def _bucket_calls(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[list[dict[str, Any]], bool]]:
    """(buckets, final) of each call, in order; a CUDA bucket's buffer lives until the next."""
    buckets = plan_tensor_buckets(named, bucket_bytes)
    if not named[0][1].is_cuda:
        yield [cpu_bucket(bucket) for bucket in buckets], True
        return
    for i, bucket in enumerate(buckets):
        with cuda_bucket(bucket) as encoded:
            yield [encoded], i == len(buckets) - 1
