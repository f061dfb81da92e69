"""Choose between a compiled implementation of a custom op and its pure-torch reference.

Compiled ops come from two places: the csrc library, which registers `torch.ops.shoal.<name>`
when it is loaded (shoal/kernels/_C.py), and Python kernels (Triton) that call
`register_kernel(name, fn)` (shoal/kernels/triton/). Either is used only for CUDA tensors and
only when `SHOAL_DISABLE_CSRC` is off; everything else (CPU, tests, a machine without the built
library) runs the `<op>_ref` function beside each wrapper. Both are loaded lazily, on the first
CUDA tensor, so CPU processes never import triton or look for the library.

A registered kernel must take exactly the arguments of the wrapper's compiled call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from shoal import envs

logger = logging.getLogger(__name__)

_KERNELS: dict[str, Callable[..., object]] = {}
_loaded = False


def register_kernel(name: str, fn: Callable[..., object]) -> None:
    """Use `fn` for the op `name` on CUDA tensors (takes precedence over `torch.ops.shoal`)."""
    logger.debug("registered kernel %s", name)
    _KERNELS[name] = fn


def unregister_kernel(name: str) -> None:
    _KERNELS.pop(name, None)


def _load_compiled() -> None:
    """Load the csrc library and register the Triton kernels, once per process."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from shoal.kernels import _C
    from shoal.kernels.triton import register_triton_kernels

    _C.load()
    register_triton_kernels()


def _on_gpu(tensor: torch.Tensor) -> bool:
    return not envs.SHOAL_DISABLE_CSRC and tensor.device.type == "cuda"


def registered_kernel(name: str, tensor: torch.Tensor) -> Callable[..., object] | None:
    """The Python (Triton) kernel registered for `name`, if any, for `tensor`'s device."""
    if not _on_gpu(tensor):
        return None
    _load_compiled()
    return _KERNELS.get(name)


def csrc_op(name: str, tensor: torch.Tensor) -> Callable[..., object] | None:
    """`torch.ops.shoal.<name>` from the csrc library, if loaded, for `tensor`'s device."""
    if not _on_gpu(tensor):
        return None
    _load_compiled()
    # torch.ops namespaces resolve ops lazily; hasattr is False until the library registers it.
    return getattr(torch.ops.shoal, name) if hasattr(torch.ops.shoal, name) else None


def compiled_op(name: str, tensor: torch.Tensor) -> Callable[..., object] | None:
    """The compiled implementation of `name` for `tensor`'s device (a registered kernel first,
    then the csrc op), or None to use the reference."""
    return registered_kernel(name, tensor) or csrc_op(name, tensor)


def has_op(name: str, tensor: torch.Tensor) -> bool:
    return compiled_op(name, tensor) is not None
