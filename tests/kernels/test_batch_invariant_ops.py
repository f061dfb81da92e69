"""The batch-invariant ops (shoal/kernels/batch_invariant.py, batch_invariant_attention.py): a
row's result is the same bits whatever the batch around it, on this machine's torch, and close
to the default ops' result; the Triton kernels likewise under the interpreter and on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.kernels import batch_invariant as bi
from shoal.kernels.batch_invariant_attention import paged_attention_ref
from shoal.kernels.fused_moe import fused_moe_ref
from shoal.kernels.paged_attention import paged_attention_ref as default_attention_ref
from shoal.kernels.rms_norm import rms_norm_ref
from tests.kernels.batch_invariant_cases import SCHEDULES, AttentionCase, check_schedules_agree
from tests.kernels.interpreter import needs_triton, run_interpreter_check

ROW_COUNTS = [1, 2, 3, 5, 7, 11, 16, 17, 33, 64]


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread unless a test asks for more (`threads`), as an engine's CPU worker on
    two cores runs: on a busy machine every op of two threads waits for the slower one."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest, one_thread: None) -> int:
    """torch's CPU kernels split work by thread count: check with one and two threads."""
    torch.set_num_threads(request.param)
    return request.param


def _rows_agree(fn, x: torch.Tensor) -> list[int]:
    """Row counts m at which fn(x[:m]) differs in any bit from fn(x)[:m]."""
    full = fn(x)
    return [m for m in ROW_COUNTS if not torch.equal(fn(x[:m]), full[:m])]


@pytest.mark.parametrize("k, n", [(64, 384), (576, 1536)])
def test_linear_rows_do_not_depend_on_the_batch(threads: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k + n)
    x, weight, bias = torch.randn(64, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    assert _rows_agree(lambda rows: bi.linear(rows, weight, bias), x) == []
    torch.testing.assert_close(bi.linear(x, weight, bias), F.linear(x, weight, bias))
    # One GEMM over all the tiles: a row's bits the same in a prefill-sized M.
    big = torch.cat([x, torch.randn(1024 - 64, k, generator=gen)])
    assert torch.equal(bi.linear(big, weight, bias)[:64], bi.linear(x, weight, bias))


def test_a_row_in_any_slot_of_a_tile_gives_the_same_bits(threads: int) -> None:
    """What the row tiles rely on: a tile's row does not depend on its slot or its neighbours."""
    gen = torch.Generator().manual_seed(1)
    weight, row = torch.randn(1536, 576, generator=gen), torch.randn(576, generator=gen)
    results = []
    for slot in range(bi.ROW_TILE):
        tile = torch.randn(bi.ROW_TILE, 576, generator=gen)
        tile[slot] = row
        results.append(F.linear(tile, weight)[slot])
    assert all(torch.equal(r, results[0]) for r in results)


def test_rms_norm_and_swiglu_rows_do_not_depend_on_the_batch(threads: int) -> None:
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(64, 576, generator=gen) * 3, torch.rand(576, generator=gen) + 0.5
    assert _rows_agree(lambda rows: bi.rms_norm(rows, weight, 1e-5), x) == []
    expected = torch.empty_like(x)
    rms_norm_ref(expected, x, weight, 1e-5)
    torch.testing.assert_close(bi.rms_norm(x, weight, 1e-5), expected)
    gate_up = torch.randn(64, 2 * 300, generator=gen)
    assert _rows_agree(bi.silu_and_mul_rows, gate_up) == []
    torch.testing.assert_close(bi.silu_and_mul_rows(gate_up), F.silu(gate_up[:, :300]) * gate_up[:, 300:])


def test_sampler_rows_do_not_depend_on_the_batch() -> None:
    """The sampler has no batch-invariant twin: its log-softmax, softmax, sort and cumsum are
    already row by row on the CPU, and a seeded row draws from its own generator."""
    from shoal.workers.sampler import Sampler, SamplingMetadata

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 49152, generator=gen) * 4

    def sample(rows: torch.Tensor) -> torch.Tensor:
        num_rows = rows.shape[0]
        md = SamplingMetadata(
            temperature=torch.full((num_rows,), 0.8), greedy=torch.zeros(num_rows, dtype=torch.bool),
            all_greedy=False, any_greedy=False, top_k=torch.full((num_rows,), 50), top_p=torch.full((num_rows,), 0.9),
            min_p=None, generators={i: torch.Generator().manual_seed(i) for i in range(num_rows)}, max_num_logprobs=2,
            repetition_penalty=None, frequency_penalty=None, presence_penalty=None, prompt_token_ids=None,
            output_token_ids=None, min_tokens_mask=[],
        )  # fmt: skip
        out = Sampler()(rows, md)
        assert out.logprobs is not None
        return torch.cat([out.sampled_token_ids[:, None].double(), out.logprobs.double()], dim=1)

    full = sample(logits)
    for m in (1, 3, 17):  # row i's generator is seeded i, so the first m rows keep their seeds
        assert torch.equal(sample(logits[:m]), full[:m])


def test_attention_does_not_depend_on_chunking_or_neighbours():
    case = AttentionCase(4, 2, 16, block_size=4, dtype=torch.float32, device="cpu")
    assert check_schedules_agree(paged_attention_ref, case) == []
    # And it is the same attention as the default path's, to rounding.
    for schedule in SCHEDULES.values():
        torch.testing.assert_close(
            case.run(paged_attention_ref, schedule), case.run(default_attention_ref, schedule), atol=1e-5, rtol=1e-5
        )


def test_default_attention_depends_on_the_schedule() -> None:
    """Why the mode needs its own attention (on this machine's torch): the default path's bits
    change with chunking. If a torch ever made it invariant, this test says so."""
    case = AttentionCase(4, 2, 16, block_size=4, dtype=torch.float32, device="cpu")
    assert check_schedules_agree(default_attention_ref, case) != []


def test_fused_moe_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(4)
    num_tokens, hidden, intermediate, num_experts, top_k = 48, 64, 32, 8, 2
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * 0.1
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen) * 0.1
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])

    def moe(m: int) -> torch.Tensor:
        return bi.fused_moe(x[:m], w13, w2, topk_weights[:m], topk_ids[:m])

    full = moe(num_tokens)
    assert [m for m in (1, 2, 5, 17, 33) if not torch.equal(moe(m), full[:m])] == []
    torch.testing.assert_close(full, fused_moe_ref(x, w13, w2, topk_weights, topk_ids))


@needs_triton
def test_triton_kernels_under_the_interpreter() -> None:
    run_interpreter_check("tests.kernels.triton_batch_invariant_check")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernels_on_gpu(dtype: torch.dtype) -> None:
    from tests.kernels.triton_batch_invariant_check import check_all

    assert check_all("cuda", dtype) == []
