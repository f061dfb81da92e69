"""Run the Triton paged-attention kernels under Triton's interpreter on CPU tensors and compare
them with the reference, with the fresh prompts of batches with prefill tokens in the unified
kernel and sent to SDPA; exits non-zero on a mismatch.

    TRITON_INTERPRET=1 python -m tests.kernels.triton_interpreter_check

test_triton_paged_attention.py runs this in a subprocess, because the interpreter is chosen when
the kernels are decorated, at import. float32 and float16 only: the interpreter's tl.dot on
bfloat16 multiplies the raw bits (bfloat16 is covered by the GPU test).
"""

from __future__ import annotations

import sys

import torch

from shoal.kernels import fresh_prefill_attention
from shoal.kernels.fresh_prefill_attention import plan_fresh_prefills
from shoal.kernels.paged_attention import paged_attention_ref
from tests.kernels.interpreter import prepare_interpreter
from tests.kernels.metadata_utils import make_paged_attention_inputs, new_keys_and_values

# (query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, num_splits)
CASES = [
    ([1, 1, 1], [9, 1, 30], 4, 2, 32, 4, torch.float32, 0),  # decode, one split each
    ([1, 1, 1], [9, 1, 300], 4, 2, 32, 4, torch.float32, 3),  # decode, split-K and an empty split
    ([1, 1], [100, 7], 6, 2, 64, 16, torch.float16, 2),  # decode, GQA 3, fp16
    ([5], [5], 4, 4, 32, 1, torch.float32, 0),  # one prefill, block size 1
    ([4, 3], [10, 3], 4, 1, 16, 4, torch.float32, 0),  # chunked prefill after a cached prefix, MQA
    ([7, 1, 3, 1, 70], [7, 20, 19, 2, 90], 6, 2, 40, 16, torch.float32, 0),  # mixed; head size 40 padded
    ([7, 1, 3, 1, 12], [7, 20, 19, 2, 12], 8, 2, 64, 16, torch.float16, 0),  # mixed, fp16
    ([70, 1, 5, 0, 2], [90, 20, 5, 4, 40], 6, 2, 32, 4, torch.float32, 0),  # long request first, an empty one
    ([7, 1, 3, 1, 12], [7, 300, 19, 2, 12], 4, 2, 32, 16, torch.float32, 3),  # mixed, its decodes split
]
# Batches whose fresh prompts (seq_len == query_len > 1) group for SDPA: decodes, fresh prompts
# of equal length side by side and of other lengths, a one-token prompt (the decode kernel's, or
# the unified kernel's with split_mixed_batches off) and chunks after a cached prefix.
FRESH_CASES = [
    ([9, 9, 1, 9, 5, 1, 6, 6], [9, 9, 40, 9, 5, 1, 20, 6], 4, 2, 32, 4, torch.float32, 0),
    ([9, 9, 1, 9, 5, 1, 6, 6], [9, 9, 40, 9, 5, 1, 20, 6], 6, 2, 64, 16, torch.float16, 0),
    ([8, 8, 8, 3], [8, 8, 8, 3], 4, 1, 16, 4, torch.float32, 0),  # fresh prompts only: no paged kernel
    ([6, 1, 6], [6, 1, 6], 4, 2, 32, 4, torch.float32, 0),
]


def main() -> int:
    prepare_interpreter()
    from shoal.kernels.triton import paged_attention as kernels

    failures = 0
    # The shipped launch parameters, then other tile shapes the sweep tries and the decode
    # requests taken longest first; mixed batches with their decode requests split off (the
    # default) and whole through the unified kernel; each with and without this step's keys and
    # values, which send fresh prompts to SDPA.
    tunings = [
        (kernels.DecodeTuning(), kernels.UnifiedTuning(), True, False),
        (
            kernels.DecodeTuning(block_n=32, programs_per_sm=64, heads_fastest=not kernels.DecodeTuning.heads_fastest),
            kernels.UnifiedTuning(block_m=128, block_n=32),
            True,
            True,
        ),
        (kernels.DecodeTuning(), kernels.UnifiedTuning(), False, True),
    ]
    runs = ((t, c, fresh) for t in tunings for c in CASES + FRESH_CASES for fresh in (False, True))
    for (decode, unified, split_mixed, longest_first), case, fresh in runs:
        kernels.DECODE_TUNING, kernels.UNIFIED_TUNING, kernels.SPLIT_MIXED_BATCHES = decode, unified, split_mixed
        fresh_prefill_attention.BY_SDPA = fresh  # off by default: the SDPA runs turn it on
        failures += not check(kernels.triton_paged_attention, *case, fresh=fresh, longest_first=longest_first)
        print(
            f"   with {decode} {unified} split_mixed_batches={split_mixed} fresh_prefills_by_sdpa={fresh} "
            f"longest_first={longest_first}"
        )
    for case in FRESH_CASES:
        failures += not check_unified_skips_fresh_prompts(kernels._unified_attention, *case)
    return 1 if failures else 0


def check(
    triton_paged_attention,
    query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, num_splits,
    fresh: bool = False,
    longest_first: bool = False,
) -> bool:  # fmt: skip
    """Every row of the batch written (out starts as NaN) and equal to the reference."""
    query, kv_cache, md = make_paged_attention_inputs(
        query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype
    )
    scale = head_size**-0.5
    expected = paged_attention_ref(query, kv_cache, md, scale).float()
    out = torch.full_like(query, float("nan"))
    extra = {}
    if fresh:
        key, value = new_keys_and_values(kv_cache, md)
        plan = plan_fresh_prefills(md.query_start_loc_cpu.numpy(), md.seq_lens_cpu.numpy())
        extra = {"key": key, "value": value, "fresh_prefill_plan": plan}
    if longest_first:  # the decode kernel takes the requests in this order
        extra["decode_order"] = torch.argsort(md.seq_lens, descending=True, stable=True).to(torch.int32)
    triton_paged_attention(
        out, query, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables,
        md.max_query_len, md.max_seq_len, scale, num_splits, **extra,
    )  # fmt: skip
    error = (out.float() - expected).abs().max().item()
    return _report(error <= _tolerance(dtype), error, query_lens, seq_lens, num_heads, num_kv_heads, head_size,
                   block_size, dtype, f"splits={num_splits}{' fresh prompts by SDPA' if fresh else ''}"
                   f"{' longest first' if longest_first else ''}")  # fmt: skip


def check_unified_skips_fresh_prompts(
    unified_attention, query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, num_splits
) -> bool:
    """The unified kernel with SKIP_FRESH and SKIP_DECODES writes the chunks after a cached
    prefix, as the reference does, and leaves every other row alone."""
    query, kv_cache, md = make_paged_attention_inputs(
        query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype
    )
    scale = head_size**-0.5
    expected = paged_attention_ref(query, kv_cache, md, scale).float()
    out = torch.full_like(query, float("nan"))
    unified_attention(
        out, query, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, scale,
        skip_decodes=True, skip_fresh=True,
    )  # fmt: skip
    starts = md.query_start_loc_cpu.tolist()
    written = torch.zeros(query.shape[0], dtype=torch.bool)
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        written[starts[i] : starts[i + 1]] = query_len > 1 and seq_len > query_len
    error = (out[written].float() - expected[written]).abs().max().item() if written.any() else 0.0
    ok = error <= _tolerance(dtype) and bool(out[~written].isnan().all())
    return _report(ok, error, query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype,
                   "unified kernel alone, skipping decodes and fresh prompts")  # fmt: skip


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 5e-3


def _report(ok, error, query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, what) -> bool:
    print(f"{'ok  ' if ok else 'FAIL'} q={query_lens} s={seq_lens} heads={num_heads}/{num_kv_heads} "
          f"hd={head_size} bs={block_size} {dtype} {what}: max error {error:.2e}")  # fmt: skip
    return ok


if __name__ == "__main__":
    sys.exit(main())
