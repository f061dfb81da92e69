"""Choose between a compiled implementation of a custom op and its pure-torch reference.

Compiled ops come from two places: the csrc library, which registers `torch.ops.shoal.<name>`
when it is loaded, and Python kernels (Triton) that call `register_kernel(name, fn)`. Either is
used only for CUDA tensors and only when `SHOAL_DISABLE_CSRC` is off; everything else (CPU,
tests, a machine without the built library) runs the `<op>_ref` function beside each wrapper.
A registered kernel must take exactly the arguments of the wrapper's compiled call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from shoal import envs

logger = logging.getLogger(__name__)

_KERNELS: dict[str, Callable[..., object]] = {}


def register_kernel(name: str, fn: Callable[..., object]) -> None:
    """Use `fn` for the op `name` on CUDA tensors (takes precedence over `torch.ops.shoal`)."""
    logger.debug("registered kernel %s", name)
    _KERNELS[name] = fn


def unregister_kernel(name: str) -> None:
    _KERNELS.pop(name, None)


def compiled_op(name: str, tensor: torch.Tensor) -> Callable[..., object] | None:
    """The compiled implementation of `name` for `tensor`'s device, or None to use the reference."""
    if envs.SHOAL_DISABLE_CSRC or tensor.device.type != "cuda":
        return None
    if name in _KERNELS:
        return _KERNELS[name]
    # torch.ops namespaces resolve ops lazily; hasattr is False until the library registers it.
    if hasattr(torch.ops.shoal, name):
        return getattr(torch.ops.shoal, name)
    return None


def has_op(name: str, tensor: torch.Tensor) -> bool:
    return compiled_op(name, tensor) is not None
