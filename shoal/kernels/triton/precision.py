"""What `tl.dot` is told about precision, shared by the Triton kernels that take float32 inputs."""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """`input_precision` for operands of `dtype`: float32 products exactly ("ieee"; Triton's
    default rounds them to tf32); other dtypes ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"
