"""`fused_moe`: the reference against the formula, the Triton kernels under the interpreter (CPU)
and on a GPU over shapes and dtypes (with expert parallelism, inside a CUDA graph), the launch
tables and the warm-up's batch sizes."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from shoal.kernels.fused_moe import fused_moe, fused_moe_ref, warm_up_fused_moe
from tests.kernels.interpreter import needs_triton, run_interpreter_check


def _dense_formula(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * W2[e] (silu(W1[e] x) * W3[e] x), token by token, in float64."""
    intermediate = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            gate_up = w13[e].double() @ x[t].double()
            h = F.silu(gate_up[:intermediate]) * gate_up[intermediate:]
            out[t] += float(topk_weights[t, j]) * (w2[e].double() @ h)
    return out


def test_reference_is_the_formula() -> None:
    generator = torch.Generator().manual_seed(0)
    x, w13, w2 = (
        torch.randn(9, 8, generator=generator),
        torch.randn(5, 12, 8, generator=generator),
        torch.randn(5, 8, 6, generator=generator),
    )
    topk_weights, topk_ids = torch.rand(9, 5, generator=generator).topk(2, dim=-1)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids)  # CPU: the reference
    torch.testing.assert_close(out.double(), _dense_formula(x, w13, w2, topk_weights, topk_ids), rtol=1e-5, atol=1e-5)
    # Expert parallelism: experts 3 and 4 on this rank, as rows 0 and 1; the others' choices add nothing.
    expert_map = torch.tensor([-1, -1, -1, 0, 1], dtype=torch.int32)
    local_ids = torch.where(topk_ids >= 3, topk_ids, torch.full_like(topk_ids, -1))
    expected = _dense_formula(x, torch.cat([w13[:3], w13[3:]]), w2, topk_weights, local_ids)
    torch.testing.assert_close(
        fused_moe_ref(x, w13[3:], w2[3:], topk_weights, topk_ids, expert_map).double(), expected, rtol=1e-5, atol=1e-5
    )


@needs_triton
def test_triton_kernels_under_the_interpreter() -> None:
    run_interpreter_check("tests.kernels.triton_fused_moe_check")


@needs_triton
def test_launch_tables(tmp_path, monkeypatch) -> None:
    from shoal.kernels.triton import fused_moe_config as cfg

    table = {count: cfg.heuristic_launch(count, num_experts=128) for count in cfg.TOKEN_COUNTS}
    assert cfg.nearest_launch(table, 1000) == table[1024] and cfg.nearest_launch(table, 20) == table[16]
    assert cfg.nearest_launch(table, 100000) == table[16384]
    counts = cfg.warm_up_token_counts(table, 8192)
    picked = {cfg.nearest_launch(table, n) for n in range(1, 8193)}
    assert {cfg.nearest_launch(table, n) for n in counts} == picked  # every launch a run can pick
    assert len(counts) == len(picked) and max(counts) <= 8192
    # A table file overrides the heuristic, keyed by shape, device and dtype.
    launch = cfg.MoELaunch(32, cfg.MoEGemmConfig(64, 128, 1, 4, 4), cfg.MoEGemmConfig(32, 64, 8, 8, 3))
    name = cfg.config_file_name(16, 96, "cpu", "float16")
    (tmp_path / name).write_text(json.dumps({"1": launch.to_json(), "64": cfg.heuristic_launch(64, 16).to_json()}))
    monkeypatch.setattr(cfg, "CONFIG_DIR", tmp_path)
    cfg.launch_table.cache_clear()
    cfg.moe_launch_for.cache_clear()
    try:
        assert cfg.moe_launch_for(16, 96, torch.float16, torch.device("cpu"), 3) == launch
        assert cfg.MoELaunch.from_json(json.loads(json.dumps(launch.to_json()))) == launch
    finally:
        cfg.launch_table.cache_clear()
        cfg.moe_launch_for.cache_clear()


@needs_triton
def test_committed_tables_are_valid() -> None:
    from shoal.kernels.triton import fused_moe_config as cfg

    files = sorted(cfg.CONFIG_DIR.glob("E=*.json"))
    assert files, "the repository keeps at least one tuned table"
    for path in files:
        entries = {int(k): cfg.MoELaunch.from_json(v) for k, v in json.loads(path.read_text()).items()}
        assert 1 in entries and max(entries) >= 8192, path.name
        for launch in entries.values():
            for gemm in (launch.gate_up, launch.down):
                assert launch.block_size_m >= 16 and gemm.block_size_n >= 16 and gemm.block_size_k >= 16


def test_warm_up_does_nothing_on_cpu() -> None:
    assert warm_up_fused_moe(torch.zeros(4, 8, 16), torch.zeros(4, 16, 4), 2, 256) == []


# ---- GPU -------------------------------------------------------------------------------------


def _gpu_case(num_tokens, num_experts, top_k, hidden, intermediate, dtype, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=generator).to(dtype)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, device="cuda", generator=generator) * hidden**-0.5).to(
        dtype
    )
    w2 = (torch.randn(num_experts, hidden, intermediate, device="cuda", generator=generator) * intermediate**-0.5).to(
        dtype
    )
    scores = torch.randn(num_tokens, num_experts, device="cuda", generator=generator).softmax(-1)
    topk_weights, topk_ids = scores.topk(top_k, dim=-1)
    return x, w13, w2, topk_weights, topk_ids


def _assert_close_to_reference(out, x, w13, w2, topk_weights, topk_ids, expert_map=None):
    expected = fused_moe_ref(x.double(), w13.double(), w2.double(), topk_weights, topk_ids, expert_map)
    scale = expected.abs().max().item() + 1e-6
    error = (out.double() - expected).abs().max().item() / scale
    assert error < (2e-2 if out.dtype == torch.bfloat16 else 5e-3 if out.dtype == torch.float16 else 1e-4), error


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, hidden, intermediate",
    [
        (1, 8, 2, 4096, 14336),  # Mixtral-8x7B decode
        (37, 8, 2, 1024, 1000),  # odd sizes
        (256, 128, 8, 2048, 768),  # Qwen3-30B-A3B decode batch
        (2048, 128, 8, 2048, 768),  # Qwen3-30B-A3B prefill
        (64, 256, 8, 1024, 256),  # 256 experts (DeepSeek-V3's count)
        (100, 60, 4, 2048, 1408),  # Qwen1.5-MoE-A2.7B
    ],
)
def test_triton_matches_reference_on_gpu(num_tokens, num_experts, top_k, hidden, intermediate, dtype) -> None:
    from shoal.kernels.triton.fused_moe import triton_fused_moe

    case = _gpu_case(num_tokens, num_experts, top_k, hidden, intermediate, dtype)
    out = triton_fused_moe(*case)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    _assert_close_to_reference(out, *case)
    assert torch.equal(fused_moe(*case), out)  # the dispatcher takes the kernel on CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 300])
def test_triton_expert_parallel_on_gpu(num_tokens) -> None:
    from shoal.kernels.triton.fused_moe import triton_fused_moe

    x, w13, w2, topk_weights, topk_ids = _gpu_case(num_tokens, 64, 6, 1024, 512, torch.bfloat16)
    expert_map = torch.full((64,), -1, dtype=torch.int32, device="cuda")
    expert_map[16:32] = torch.arange(16, dtype=torch.int32, device="cuda")
    out = triton_fused_moe(x, w13[16:32], w2[16:32], topk_weights, topk_ids, expert_map)
    _assert_close_to_reference(out, x, w13[16:32], w2[16:32], topk_weights, topk_ids, expert_map)


@pytest.mark.gpu
def test_every_tuned_launch_runs_and_the_warm_up_covers_them() -> None:
    """Every entry of the Qwen3-30B-A3B table on this GPU (or the heuristic's) at its own batch
    size, and the warm-up's batch sizes compile all distinct ones."""
    from shoal.kernels.triton import fused_moe_config as cfg
    from shoal.kernels.triton.fused_moe import triton_fused_moe

    table = cfg.launch_table(128, 768, "bfloat16", cfg.device_name(torch.device("cuda")))
    for count, launch in sorted(table.items())[:12]:
        case = _gpu_case(count, 128, 8, 2048, 768, torch.bfloat16, seed=count)
        _assert_close_to_reference(triton_fused_moe(*case, launch=launch), *case)
    w13, w2 = _gpu_case(1, 128, 8, 2048, 768, torch.bfloat16)[1:3]
    counts = warm_up_fused_moe(w13, w2, 8, 8191)
    assert {cfg.nearest_launch(table, n) for n in counts} == {cfg.nearest_launch(table, n) for n in range(1, 8192)}
    assert warm_up_fused_moe(w13.clone(), w2.clone(), 8, 8191) == []  # a second layer of the shape: compiled


@pytest.mark.gpu
def test_triton_fused_moe_in_a_cuda_graph() -> None:
    """A decode step's launches capture: no host reads, one grid whatever the routing."""
    x, w13, w2, topk_weights, topk_ids = _gpu_case(16, 64, 4, 1024, 512, torch.bfloat16)
    fused_moe(x, w13, w2, topk_weights, topk_ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, topk_weights, topk_ids)
    for seed in (1, 2):  # new routing and inputs, copied into the captured buffers
        new = _gpu_case(16, 64, 4, 1024, 512, torch.bfloat16, seed=seed)
        x.copy_(new[0])
        topk_weights.copy_(new[3])
        topk_ids.copy_(new[4])
        graph.replay()
        _assert_close_to_reference(out, x, w13, w2, topk_weights, topk_ids)
