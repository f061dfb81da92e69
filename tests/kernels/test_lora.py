"""The batched LoRA shrink and expand (shoal/kernels/lora.py): the references against a plain
per-token loop, the Triton kernels under the interpreter (CPU) and on a GPU, in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.lora import (
    lora_expand,
    lora_expand_grouped,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_grouped,
    lora_shrink_ref,
)
from tests.kernels.interpreter import needs_triton, run_interpreter_check
from tests.kernels.lora_cases import CASES, make_inputs, per_token_loop

_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("case", CASES)
def test_references_are_the_per_token_loop(case: tuple) -> None:
    x, lora_a, lora_b, y, slots = make_inputs(*case)
    h = lora_shrink_ref(x, lora_a, slots)
    assert h.dtype == torch.float32 and (h[slots < 0] == 0).all()
    out = lora_expand_ref(y.clone(), h, lora_b, slots)
    tol = _TOLERANCE[case[-1]]
    torch.testing.assert_close(out.float(), per_token_loop(x, lora_a, lora_b, y, slots), rtol=tol, atol=tol)
    assert torch.equal(out[slots < 0], y[slots < 0])  # the base model's tokens are untouched


@pytest.mark.parametrize("case", CASES)
def test_grouped_form_is_the_per_token_loop(case: tuple) -> None:
    x, lora_a, lora_b, y, slots = make_inputs(*case)
    groups = [(s, torch.nonzero(slots == s).flatten()) for s in slots.unique().tolist() if s >= 0]
    out = lora_expand_grouped(y.clone(), lora_shrink_grouped(x, lora_a, groups), lora_b, groups)
    tol = _TOLERANCE[case[-1]]
    torch.testing.assert_close(out.float(), per_token_loop(x, lora_a, lora_b, y, slots), rtol=tol, atol=tol)
    assert torch.equal(out[slots < 0], y[slots < 0])


@needs_triton
def test_triton_kernels_under_the_interpreter() -> None:
    run_interpreter_check("tests.kernels.triton_lora_check")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_triton_kernels_on_gpu_in_a_cuda_graph(case: tuple) -> None:
    x, lora_a, lora_b, y, slots = make_inputs(*case, device="cuda")
    out = y.clone()
    lora_expand(out, lora_shrink(x, lora_a, slots), lora_b, slots)  # compiles
    out.copy_(y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_expand(out, lora_shrink(x, lora_a, slots), lora_b, slots)
    slots.copy_(slots.flip(0))  # the graph reads the slots it is replayed with
    out.copy_(y)
    graph.replay()
    tol = _TOLERANCE[case[-1]]
    torch.testing.assert_close(out.float(), per_token_loop(x, lora_a, lora_b, y, slots), rtol=tol, atol=tol)
