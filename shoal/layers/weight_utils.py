"""Helpers shared by the `weight_loader`s of every layer.

A loaded weight is either a tensor or a lazy safetensors slice (`safe_open(...).get_slice(name)`),
so that a tensor-parallel rank reads only the rows or columns of its own shard from disk. The
helpers below accept both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# A torch.Tensor, or a safetensors PySafeSlice (has get_shape() and supports slicing).
LoadedWeight = Any


def weight_shape(loaded: LoadedWeight) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow_weight(loaded: LoadedWeight, dim: int, start: int, length: int) -> torch.Tensor:
    """loaded.narrow(dim, start, length), reading only that part of a lazy slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = (slice(None),) * dim + (slice(start, start + length),)
    return loaded[index]


def full_weight(loaded: LoadedWeight) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def copy_weight(target: torch.Tensor, source: torch.Tensor) -> None:
    if tuple(target.shape) != tuple(source.shape):
        raise ValueError(f"weight shape {tuple(source.shape)} does not fit parameter shape {tuple(target.shape)}")
    target.copy_(source)


def default_weight_loader(param: nn.Parameter, loaded: LoadedWeight) -> None:
    """A replicated parameter: every rank holds the whole tensor."""
    copy_weight(param.data, full_weight(loaded))


def new_parameter(*shape: int, weight_loader: Any = default_weight_loader) -> nn.Parameter:
    """An uninitialized inference parameter (default dtype and device) carrying its weight_loader."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param
