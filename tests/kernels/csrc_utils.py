"""Helpers for the GPU tests of the compiled ops: they fail, rather than skip, when the library
is missing, since the GPU run exists to test it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shoal.kernels import _C

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def csrc_op(name: str) -> Callable[..., object]:
    """torch.ops.shoal.<name> from the built library."""
    assert _C.load(), "shoal/_C.so is not loaded: build it with `python -m shoal.kernels.build`"
    return getattr(torch.ops.shoal, name)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for a kernel that computes in float32 but may round or sum in a
    different order than the reference: a few units in the last place of the dtype."""
    return {
        torch.float32: {"rtol": 1e-5, "atol": 1e-5},
        torch.float16: {"rtol": 2e-3, "atol": 2e-3},
        torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
    }[dtype]
