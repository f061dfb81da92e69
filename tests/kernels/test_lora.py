"""The batched LoRA shrink and expand (shoal/kernels/lora.py): the references against a plain
per-token loop, the Triton kernels under the interpreter (CPU) and on a GPU, in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.lora import (
    LoRASegments,
    lora_expand,
    lora_expand_grouped,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_grouped,
    lora_shrink_ref,
    sort_tokens_by_slot,
)
from shoal.lora.layers import TokenSlots
from tests.kernels.interpreter import needs_triton, run_interpreter_check
from tests.kernels.lora_cases import CASES, SEGMENT_CASES, make_inputs, per_token_loop

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


def test_tokens_sorted_by_slot_give_each_slot_its_tokens_in_order() -> None:
    gen = torch.Generator().manual_seed(3)
    for num_tokens in (0, 1, 9, 100):
        slots = torch.randint(-1, 4, (num_tokens,), generator=gen, dtype=torch.int32)
        segments = LoRASegments.of(torch.from_numpy(sort_tokens_by_slot(slots.numpy(), 4)), 4)
        for slot in range(4):
            start, count = int(segments.starts[slot]), int(segments.counts[slot])
            expected = torch.nonzero(slots == slot).flatten().tolist()
            assert segments.sorted_tokens[start : start + count].tolist() == expected
        assert int(segments.counts.sum()) == int((slots >= 0).sum())


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + SEGMENT_CASES)
def test_triton_kernels_on_gpu_in_a_cuda_graph(case: tuple) -> None:
    """The segment kernels, captured once, replayed with another step's slots and segments
    written into the same buffers."""
    x, lora_a, lora_b, y, slots = make_inputs(*case, device="cuda")
    num_slots = lora_a.shape[0]
    segments = TokenSlots.of(slots, num_slots).segments
    out = y.clone()

    def forward() -> None:
        lora_expand(out, lora_shrink(x, lora_a, slots, segments), lora_b, slots, segments)

    forward()  # compiles
    torch.testing.assert_close(out.float(), per_token_loop(x, lora_a, lora_b, y, slots), **_tol(case))
    out.copy_(y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    slots.copy_(slots.flip(0))  # the graph reads the slots and segments it is replayed with
    next_step = TokenSlots.of(slots, num_slots).segments
    for buffer, values in zip(
        (segments.starts, segments.counts, segments.sorted_tokens),
        (next_step.starts, next_step.counts, next_step.sorted_tokens),
    ):
        buffer.copy_(values)
    out.copy_(y)
    graph.replay()
    torch.testing.assert_close(out.float(), per_token_loop(x, lora_a, lora_b, y, slots), **_tol(case))


def _tol(case: tuple) -> dict[str, float]:
    return {"rtol": _TOLERANCE[case[-1]], "atol": _TOLERANCE[case[-1]]}
