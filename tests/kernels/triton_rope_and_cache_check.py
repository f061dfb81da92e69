"""Run the Triton `rope_and_cache` kernel under Triton's interpreter on CPU tensors and compare it
with the reference; exits non-zero on a mismatch.

    TRITON_INTERPRET=1 python -m tests.kernels.triton_rope_and_cache_check

test_rope_and_cache.py runs this in a subprocess (the interpreter is chosen when the kernels are
decorated, at import) and reuses `check` for the GPU test.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from shoal.kernels.rope_and_cache import rope_and_cache_ref

SENTINEL = -1234.0  # what every cache entry holds before the write; exact in float16 and bfloat16


@dataclass(frozen=True)
class Case:
    num_tokens: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rotary_dim: int
    is_neox: bool
    norm: bool
    dtype: torch.dtype
    block_size: int = 4
    row_padding: int = 0  # qkv as the rows of a wider tensor (a strided view)
    positions_dtype: torch.dtype = torch.int64
    cache_in_float32: bool = True

    def __str__(self) -> str:
        return (f"T={self.num_tokens} heads={self.num_heads}/{self.num_kv_heads} hd={self.head_size} "
                f"rot={self.rotary_dim} {'neox' if self.is_neox else 'gptj'} norm={self.norm} {self.dtype}")  # fmt: skip


CASES = [
    Case(5, 4, 2, 32, 32, True, False, torch.float16),
    Case(5, 4, 2, 32, 16, False, False, torch.bfloat16),  # partial rotary
    Case(6, 4, 2, 64, 64, True, True, torch.bfloat16, block_size=16, positions_dtype=torch.int32),
    Case(6, 4, 2, 64, 32, False, True, torch.float16, row_padding=24, cache_in_float32=False),
    Case(4, 2, 1, 40, 20, True, True, torch.float16, block_size=1),  # head size not a power of two, MQA
    Case(4, 3, 1, 32, 32, False, True, torch.bfloat16, row_padding=8),
    Case(1, 4, 2, 32, 32, True, True, torch.bfloat16),  # one decode token
]


def cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, rotary_dim]


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> dict:
    """The keyword arguments of rope_and_cache for `case`, the cache filled with SENTINEL."""
    generator = torch.Generator().manual_seed(seed)
    c, dtype = case, case.dtype
    width = (c.num_heads + 2 * c.num_kv_heads) * c.head_size
    rows = torch.randn(c.num_tokens, width + c.row_padding, generator=generator).to(dtype)
    num_blocks = (2 * c.num_tokens + c.block_size - 1) // c.block_size + 1
    slots = torch.randperm(num_blocks * c.block_size, generator=generator)[: c.num_tokens]
    if c.num_tokens > 2:  # padding (-1) in the middle and at the end; a lone decode token is written
        slots[c.num_tokens // 2] = -1
        slots[-1] = -1
    cache = cos_sin_cache(4096, c.rotary_dim)
    weights = {}
    if c.norm:
        for name in ("q_norm_weight", "k_norm_weight"):
            weights[name] = (1.0 + 0.3 * torch.randn(c.head_size, generator=generator)).to(device, dtype)
    return dict(
        positions=torch.randint(0, 4096, (c.num_tokens,), generator=generator).to(device, c.positions_dtype),
        qkv=rows.to(device)[:, :width],
        kv_cache=torch.full((2, num_blocks, c.block_size, c.num_kv_heads, c.head_size), SENTINEL, dtype=dtype, device=device),
        slot_mapping=slots.to(device),
        cos_sin_cache=cache.to(device, torch.float32 if c.cache_in_float32 else dtype),
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_size=c.head_size,
        is_neox=c.is_neox,
        eps=1e-6,
        **weights,
    )  # fmt: skip


def check(kernel: Callable[..., None], case: Case, device: torch.device) -> list[str]:
    """Failures of `kernel` against the reference on `case`: q and k within about one unit in the
    last place (of the larger inputs), v untouched, the cache written exactly at the reference's
    slots, with the kernel's own keys and the values, and nowhere else."""
    args = make_inputs(case, device)
    expected = {**args, "qkv": args["qkv"].clone(), "kv_cache": args["kv_cache"].clone()}
    value_before = args["qkv"][:, (case.num_heads + case.num_kv_heads) * case.head_size :].clone()
    rope_and_cache_ref(**expected)
    kernel(**args)
    qkv, kv_cache, qkv_ref = args["qkv"], args["kv_cache"], expected["qkv"]

    failures = []
    q_k = (case.num_heads + case.num_kv_heads) * case.head_size
    eps = torch.finfo(case.dtype).eps
    out, ref = qkv[:, :q_k].float(), qkv_ref[:, :q_k].float()
    error = (out - ref).abs()
    allowed = 2 * eps * ref.abs().amax() + eps * ref.abs()  # ~1 ulp of the pair's inputs + 1 of the result
    if not bool((error <= allowed).all()):
        failures.append(f"{case}: q/k max error {error.max().item():.3g} > {allowed.max().item():.3g}")
    if not torch.equal(qkv[:, q_k:], value_before):
        failures.append(f"{case}: v changed in qkv")

    key_cache, value_cache = (x.view(-1, case.num_kv_heads, case.head_size) for x in kv_cache)  # [slots, ...]
    written = torch.zeros(key_cache.shape[0], dtype=torch.bool, device=device)
    for token, slot in enumerate(args["slot_mapping"].tolist()):
        if slot < 0:
            continue
        written[slot] = True
        key = qkv[token, case.num_heads * case.head_size : q_k].view(case.num_kv_heads, case.head_size)
        value = value_before[token].view_as(key)
        if not (torch.equal(key_cache[slot], key) and torch.equal(value_cache[slot], value)):
            failures.append(f"{case}: slot {slot} does not hold token {token}'s key and value")
    if not bool((kv_cache[:, ~written.view(kv_cache.shape[1:3])] == SENTINEL).all()):
        failures.append(f"{case}: the cache was written outside the tokens' slots")
    ref_cache = expected["kv_cache"].view(2, -1, case.num_kv_heads, case.head_size)
    if not torch.equal((ref_cache != SENTINEL).any(-1).any(-1), written.expand(2, -1)):
        failures.append(f"{case}: the reference wrote other slots (a bad test case)")
    return failures


def _patch_interpreter_bfloat16_rounding() -> None:
    """triton 3.6's interpreter casts float32 to bfloat16 by truncation; GPUs (and torch) round
    to nearest even. Round like them, so the check compares the kernel's arithmetic, not that."""
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32)
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            return interpreter.TensorHandle(rounded.astype(np.uint16), tl.bfloat16)
        return original(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


def main() -> int:
    from tests.kernels.interpreter import prepare_interpreter

    prepare_interpreter()
    _patch_interpreter_bfloat16_rounding()
    from shoal.kernels.triton.rope_and_cache import triton_rope_and_cache

    failures = []
    for case in CASES:
        case_failures = check(triton_rope_and_cache, case, torch.device("cpu"))
        print(f"{'FAIL' if case_failures else 'ok  '} {case}")
        failures += case_failures
    print("\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
