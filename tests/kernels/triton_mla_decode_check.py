"""Run the Triton MLA kernels (`mla_decode`, split and unsplit, and `concat_and_cache_mla`) under
Triton's interpreter on CPU tensors and compare them with the references; exits non-zero on a
mismatch. float32 and float16 for the attention: the interpreter's tl.dot on bfloat16 multiplies
the raw bits (bfloat16 is covered by the GPU test).

    TRITON_INTERPRET=1 python -m tests.kernels.triton_mla_decode_check

test_mla_decode.py runs this in a subprocess and reuses `check_decode` / `check_cache_write`
for the GPU test.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.kernels.concat_and_cache_mla import concat_and_cache_mla_ref
from shoal.kernels.mla_decode import mla_decode_ref


@dataclass(frozen=True)
class Case:
    seq_lens: tuple[int, ...]
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype
    block_size: int = 4
    num_splits: int = 0  # 0: the kernel chooses
    max_seq_len: int | None = None  # the grid's bound (a CUDA graph's), else the longest context

    def __str__(self) -> str:
        return (f"lens={self.seq_lens} heads={self.num_heads} rank={self.kv_lora_rank} rope={self.rope_dim} "
                f"bs={self.block_size} splits={self.num_splits} {self.dtype}")  # fmt: skip


CASES = [
    Case((5, 1, 13), 4, 32, 8, torch.float32),
    Case((5, 1, 13), 4, 32, 8, torch.float32, num_splits=3),  # split-K, a split past a context
    Case(
        (40, 7), 80, 48, 16, torch.float16, num_splits=4, max_seq_len=64
    ),  # two head blocks of 64, bound past the batch
    Case((9,), 2, 64, 16, torch.float16, block_size=16),
]


def make_decode_inputs(case: Case, device: torch.device, seed: int = 0) -> dict:
    """mla_decode's arguments for `case`: random latents in shuffled blocks, one query a request."""
    generator = torch.Generator().manual_seed(seed)
    c = case
    latent = c.kv_lora_rank + c.rope_dim
    blocks_per_req = [-(-n // c.block_size) for n in c.seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(blocks_per_req)
    tables, used = [], 0
    for count in blocks_per_req:
        tables.append(order[used : used + count] + [0] * (width - count))
        used += count
    cache = torch.randn(1, num_blocks, c.block_size, 1, latent, generator=generator)
    query = torch.randn(len(c.seq_lens), c.num_heads, latent, generator=generator)
    return dict(
        query=query.to(device, c.dtype),
        kv_cache=cache.to(device, c.dtype),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(c.seq_lens, dtype=torch.int32, device=device),
        max_seq_len=c.max_seq_len or max(c.seq_lens),
        scale=(c.kv_lora_rank + c.rope_dim) ** -0.5,
    )


def check_decode(kernel: Callable[..., None], case: Case, device: torch.device) -> list[str]:
    """The kernel's output against the reference's (computed in float32 from the same inputs),
    within the rounding of the output dtype."""
    args = make_decode_inputs(case, device)
    out = args["query"].new_full((*args["query"].shape[:-1], case.kv_lora_rank), float("nan"))
    kernel(out, **args, num_splits=case.num_splits)
    expected = torch.empty(out.shape, dtype=torch.float32, device=device)
    ref_args = {**args, "query": args["query"].float(), "kv_cache": args["kv_cache"].float()}
    mla_decode_ref(expected, **ref_args)
    tolerance = 1e-5 if case.dtype == torch.float32 else 2e-2
    error = (out.float() - expected).abs().max().item()
    return [] if error <= tolerance else [f"{case}: max error {error:.3g} > {tolerance}"]


def check_cache_write(kernel: Callable[..., None], dtype: torch.dtype, device: torch.device) -> list[str]:
    """Five tokens (one padding slot) into a cache of 3 blocks of 4: the reference's cache exactly."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 32 + 8 + 6, generator=generator).to(device, dtype)  # strided views of wider rows
    kv_c, k_pe = rows[:, :32], rows[:, 38:]
    slots = torch.tensor([9, 2, -1, 11, 4], device=device)
    cache = torch.full((1, 3, 4, 1, 40), -7.0, dtype=dtype, device=device)
    expected = cache.clone()
    concat_and_cache_mla_ref(kv_c, k_pe, expected, slots)
    kernel(kv_c, k_pe, cache, slots)
    return [] if torch.equal(cache, expected) else [f"concat_and_cache_mla {dtype}: the cache differs"]


def main() -> int:
    from tests.kernels.interpreter import prepare_interpreter

    prepare_interpreter()
    from shoal.kernels.triton.mla_decode import triton_concat_and_cache_mla, triton_mla_decode

    failures = []
    for case in CASES:
        case_failures = check_decode(triton_mla_decode, case, torch.device("cpu"))
        print(f"{'FAIL' if case_failures else 'ok  '} {case}")
        failures += case_failures
    for dtype in (torch.float32, torch.bfloat16):
        failures += check_cache_write(triton_concat_and_cache_mla, dtype, torch.device("cpu"))
    print("\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
