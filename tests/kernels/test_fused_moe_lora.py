"""`fused_moe_lora` (shoal/kernels/fused_moe_lora.py): the reference against the formula (with
expert parallelism too), the base model's tokens exactly `fused_moe`'s, the Triton composition
under the interpreter (CPU) and on a GPU, in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.fused_moe import fused_moe_ref
from shoal.kernels.fused_moe_lora import fused_moe_lora, fused_moe_lora_ref
from tests.kernels.fused_moe_lora_cases import formula, make_inputs
from tests.kernels.interpreter import needs_triton, run_interpreter_check


@pytest.mark.parametrize("shape", [(1, 4, 2, 16, 8), (9, 6, 3, 24, 12)])
def test_reference_is_the_formula(shape: tuple) -> None:
    inputs = make_inputs(*shape, num_slots=3, rank=4)
    out = fused_moe_lora(*inputs.values())  # CPU: the reference
    torch.testing.assert_close(out.double(), formula(inputs), rtol=1e-5, atol=1e-5)
    # Expert parallelism: the rank holds experts 2.. as rows 0..; the others' choices add nothing.
    inputs["expert_map"] = torch.tensor([-1, -1, *range(shape[1] - 2)], dtype=torch.int32)
    for key in ("w13", "w2"):
        inputs[key] = inputs[key][2:]
    for key in ("gate_up_a", "gate_up_b", "down_a", "down_b"):
        inputs[key] = inputs[key][:, 2:]
    torch.testing.assert_close(fused_moe_lora_ref(*inputs.values()).double(), formula(inputs), rtol=1e-5, atol=1e-5)


def test_base_model_tokens_are_fused_moe_exactly() -> None:
    inputs = make_inputs(7, 4, 2, 16, 8, num_slots=2, rank=4)
    out = fused_moe_lora_ref(*inputs.values())
    base = fused_moe_ref(*(inputs[k] for k in ("hidden_states", "w13", "w2", "topk_weights", "topk_ids")))
    without = inputs["token_slots"] < 0
    assert torch.equal(out[without], base[without])
    assert not torch.allclose(out[~without], base[~without])


@needs_triton
def test_triton_under_the_interpreter() -> None:
    run_interpreter_check("tests.kernels.triton_fused_moe_lora_check")


def assert_as_close_as_the_reference(out: torch.Tensor, inputs: dict) -> None:
    """float32: within 1e-4 of the formula. bf16 rounds every intermediate (gate_up, the LoRA
    products, each expert's output), and with hidden 2048 a few of many thousand entries land
    past a fixed tolerance: there the kernel's largest error from the formula may be at most
    twice the torch reference's, run in bf16 on the same inputs."""
    expected = formula(inputs).to(out.device)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)
        return
    reference_error = (fused_moe_lora_ref(*inputs.values()).double() - expected).abs().max().item()
    error = (out.double() - expected).abs().max().item()
    assert error <= 2 * reference_error + 1e-3, (error, reference_error)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 8, 2, 1024, 512), (37, 128, 8, 2048, 768), (300, 60, 4, 2048, 1408)])
def test_triton_on_gpu_in_a_cuda_graph(shape: tuple, dtype: torch.dtype) -> None:
    inputs = make_inputs(*shape, num_slots=4, rank=16, dtype=dtype, device="cuda")
    assert_as_close_as_the_reference(fused_moe_lora(*inputs.values()), inputs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_lora(*inputs.values())
    inputs["token_slots"].copy_(inputs["token_slots"].flip(0))  # the graph reads the slots it replays with
    graph.replay()
    assert_as_close_as_the_reference(out, inputs)


@pytest.mark.gpu
def test_warm_up_runs_every_launch_once_per_shape() -> None:
    from shoal.kernels.fused_moe_lora import warm_up_fused_moe_lora

    inputs = make_inputs(1, 8, 2, 1024, 512, num_slots=2, rank=16, dtype=torch.bfloat16, device="cuda")
    lora = (inputs["gate_up_a"], inputs["gate_up_b"], inputs["down_a"], inputs["down_b"])
    counts = warm_up_fused_moe_lora(inputs["w13"], inputs["w2"], 2, 512, None, lora)
    assert counts and counts[-1] == 512
    assert warm_up_fused_moe_lora(inputs["w13"], inputs["w2"], 2, 512, None, lora) == []  # compiled already
