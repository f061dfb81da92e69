from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.kernels import fresh_prefill_attention as fresh_module
from shoal.kernels.fresh_prefill_attention import (
    FreshPrefillPlan,
    PromptGroup,
    fresh_prefill_attention,
    plan_fresh_prefills,
)
from shoal.kernels.paged_attention import paged_attention_ref
from tests.kernels.attention_cases import GPU_HEADS, GPU_TOLERANCE
from tests.kernels.interpreter import needs_triton
from tests.kernels.metadata_utils import make_paged_attention_inputs, new_keys_and_values


def _plan(query_lens: list[int], seq_lens: list[int]) -> FreshPrefillPlan:
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    return plan_fresh_prefills(query_start_loc, np.array(seq_lens, dtype=np.int64))


def test_plan_groups_adjacent_fresh_prompts_of_equal_length() -> None:
    plan = _plan([1024] * 8, [1024] * 8)
    assert plan == FreshPrefillPlan(groups=(PromptGroup(0, 8, 1024),), num_decodes=0, num_prefix_chunks=0)


def test_plan_splits_groups_at_other_lengths_and_other_requests() -> None:
    # Their first rows: 0, 4, 8, 9, 13, 16, 17, 21, 25, 28, 30, 35.
    query_lens = [4, 4, 1, 4, 3, 1, 4, 4, 3, 2, 5, 0]
    seq_lens = [4, 4, 9, 4, 3, 1, 4, 10, 3, 2, 5, 7]
    plan = _plan(query_lens, seq_lens)
    assert plan.groups == (
        PromptGroup(0, 2, 4),  # a decode ends the group
        PromptGroup(9, 1, 4),  # another length ends the group
        PromptGroup(13, 1, 3),  # a one-token prompt is a decode: it ends the group
        PromptGroup(17, 1, 4),  # a chunk after a cached prefix ends the group
        PromptGroup(25, 1, 3),
        PromptGroup(28, 1, 2),
        PromptGroup(30, 1, 5),
    )
    assert plan.num_decodes == 2  # the one-token prompt too
    assert plan.num_prefix_chunks == 1  # the empty request is nobody's


def test_plan_of_chunks_after_a_cached_prefix() -> None:
    plan = _plan([5, 1, 3], [25, 7, 3])
    assert plan == FreshPrefillPlan(groups=(PromptGroup(6, 1, 3),), num_decodes=1, num_prefix_chunks=1)
    assert _plan([5, 6], [25, 16]) == FreshPrefillPlan(groups=(), num_decodes=0, num_prefix_chunks=2)


def _packed_keys_and_values(
    query: torch.Tensor, kv_cache: torch.Tensor, md
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key and value as views of one [num_tokens, (nh + 2 * nkv) * hd] tensor, the way an
    attention layer's fused qkv projection hands them over (token stride wider than the rows)."""
    key, value = new_keys_and_values(kv_cache, md)
    qkv = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
    q, k, v = qkv.split([query[0].numel(), key[0].numel(), value[0].numel()], dim=1)
    return q.view(query.shape), k.view(key.shape), v.view(value.shape)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (4, 1)])
def test_fresh_prefill_attention_matches_the_reference(num_heads: int, num_kv_heads: int) -> None:
    query_lens, seq_lens = [6, 6, 1, 6, 3, 4], [6, 6, 9, 6, 3, 11]
    query, kv_cache, md = make_paged_attention_inputs(
        query_lens, seq_lens, num_heads, num_kv_heads, 16, 4, torch.float32
    )
    q, k, v = _packed_keys_and_values(query, kv_cache, md)
    plan = _plan(query_lens, seq_lens)
    out = torch.full_like(query, float("nan"))
    fresh_prefill_attention(out, q, k, v, plan.groups, 16**-0.5)
    expected = paged_attention_ref(query, kv_cache, md, 16**-0.5)
    fresh_rows = [*range(0, 12), *range(13, 22)]  # the decode and the chunk after a prefix are left alone
    torch.testing.assert_close(out[fresh_rows], expected[fresh_rows], rtol=1e-5, atol=1e-5)
    assert out[[12, 22, 23, 24, 25]].isnan().all()


def _recording(calls: list[str], name: str):
    def record(*args, **kwargs) -> None:
        calls.append(name)

    return record


@needs_triton
@pytest.mark.parametrize("by_sdpa", [True, False])
def test_fresh_prompts_alone_launch_no_paged_kernel(monkeypatch, by_sdpa: bool) -> None:
    """A batch of fresh prompts only runs as SDPA, with neither Triton kernel launched (so this
    runs on CPU without the interpreter); with the switch off it takes the kernels again."""
    from shoal.kernels.triton import paged_attention as kernels

    calls: list[str] = []
    monkeypatch.setattr(kernels, "_unified_attention", _recording(calls, "unified"))
    monkeypatch.setattr(kernels, "_decode_attention", _recording(calls, "decode"))
    monkeypatch.setattr(fresh_module, "BY_SDPA", by_sdpa)
    query_lens = [8, 8, 8, 5]
    query, kv_cache, md = make_paged_attention_inputs(query_lens, query_lens, 8, 2, 32, 4, torch.float32)
    q, k, v = _packed_keys_and_values(query, kv_cache, md)
    out = torch.full_like(query, float("nan"))
    kernels.triton_paged_attention(
        out, q, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, 8, 8, 0.2,
        key=k, value=v, fresh_prefill_plan=_plan(query_lens, query_lens),
    )  # fmt: skip
    if by_sdpa:
        assert calls == []
        torch.testing.assert_close(out, paged_attention_ref(query, kv_cache, md, 0.2), rtol=1e-5, atol=1e-5)
    else:
        assert calls == ["decode", "unified"]


@needs_triton
def test_prefill_chunks_after_a_prefix_still_launch_the_unified_kernel(monkeypatch) -> None:
    """Fresh prompts next to a chunk after a cached prefix: the unified kernel runs, skipping
    the fresh prompts, and no decode kernel runs for a batch without one-token requests."""
    from shoal.kernels.triton import paged_attention as kernels

    calls: list[str] = []
    skips: list[tuple[bool, bool]] = []

    def unified(*args, skip_decodes: bool = False, skip_fresh: bool = False) -> None:
        calls.append("unified")
        skips.append((skip_decodes, skip_fresh))

    monkeypatch.setattr(kernels, "_unified_attention", unified)
    monkeypatch.setattr(kernels, "_decode_attention", _recording(calls, "decode"))
    monkeypatch.setattr(fresh_module, "BY_SDPA", True)
    query_lens, seq_lens = [8, 8, 4], [8, 8, 20]
    query, kv_cache, md = make_paged_attention_inputs(query_lens, seq_lens, 4, 2, 16, 4, torch.float32)
    k, v = new_keys_and_values(kv_cache, md)
    out = torch.full_like(query, float("nan"))
    kernels.triton_paged_attention(
        out, query, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, 8, 20, 0.25,
        key=k, value=v, fresh_prefill_plan=_plan(query_lens, seq_lens),
    )  # fmt: skip
    assert calls == ["unified"] and skips == [(True, True)]
    torch.testing.assert_close(out[:16], paged_attention_ref(query, kv_cache, md, 0.25)[:16], rtol=1e-5, atol=1e-5)
    assert out[16:].isnan().all()  # the chunk after the prefix is the (here absent) unified kernel's


# --- on the GPU: the engine's path through the wrapper, against the reference --------------------

# (query_lens, seq_lens): fresh prompts of one length (one SDPA call), of several lengths next to
# decodes and a chunk after a cached prefix, and long prompts beside long decodes.
GPU_FRESH_BATCHES = [
    ([256] * 4, [256] * 4),
    ([100, 100, 1, 37, 1, 64, 200, 200], [100, 100, 900, 37, 5, 300, 200, 200]),
    ([1, 1, 2048, 1000], [3000, 17, 2048, 1000]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", GPU_FRESH_BATCHES)
@pytest.mark.parametrize("num_heads,num_kv_heads", GPU_HEADS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fresh_prompts_by_sdpa_on_gpu(monkeypatch, batch, num_heads, num_kv_heads, dtype) -> None:
    from shoal.kernels.paged_attention import paged_attention

    groups_run: list[PromptGroup] = []

    def recording_sdpa(out, query, key, value, groups, scale) -> None:
        groups_run.extend(groups)
        fresh_prefill_attention(out, query, key, value, groups, scale)

    monkeypatch.setattr(fresh_module, "fresh_prefill_attention", recording_sdpa)
    monkeypatch.setattr(fresh_module, "BY_SDPA", True)
    query_lens, seq_lens = batch
    query, kv_cache, md = make_paged_attention_inputs(
        query_lens, seq_lens, num_heads, num_kv_heads, 128, 16, dtype, device="cuda"
    )
    q, k, v = _packed_keys_and_values(query, kv_cache, md)
    padded = torch.cat([q, torch.randn_like(q[:2])])  # rows past the batch stay zero
    out = paged_attention(padded, kv_cache, md, 128**-0.5, key=k, value=v)
    expected = paged_attention_ref(query, kv_cache, md, 128**-0.5)
    torch.testing.assert_close(out[: md.num_tokens], expected, **GPU_TOLERANCE[dtype])
    assert torch.count_nonzero(out[md.num_tokens :]) == 0
    assert tuple(groups_run) == _plan(query_lens, seq_lens).groups
