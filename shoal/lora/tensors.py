"""An adapter's tensors on their way from a trainer to the engine core: one safetensors blob
(bytes cross the frontend ↔ engine-core socket as they are; adapters are small)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def encode_tensors(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> bytes:
    from safetensors.torch import save

    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in items}
    if not tensors:
        raise ValueError("no tensors given")
    return save(tensors)
