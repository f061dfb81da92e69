"""`rope_and_cache`: the reference against the separate ops, the Triton kernel under the
interpreter (CPU) and on a GPU, and the models' fused branch."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.reshape_and_cache import reshape_and_cache
from shoal.kernels.rms_norm import rms_norm
from shoal.kernels.rope_and_cache import fused_rope_and_cache_available, rope_and_cache
from shoal.kernels.rotary_embedding import rotary_embedding
from shoal.models import llama as llama_module
from tests.kernels.interpreter import needs_triton, run_interpreter_check
from tests.kernels.triton_rope_and_cache_check import SENTINEL, Case, check, make_inputs
from tests.models.model_utils import PagedRunner, load_shoal


def _separate_ops(positions, qkv, kv_cache, slot_mapping, cos_sin_cache, num_heads, num_kv_heads, head_size,
                  is_neox, q_norm_weight=None, k_norm_weight=None, eps=1e-6):  # fmt: skip
    """The unfused path, as LlamaAttention / Qwen3Attention and Attention run it."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if q_norm_weight is not None:
        q_heads, k_heads = q.reshape(num_tokens, -1, head_size), k.reshape(num_tokens, -1, head_size)
        q, k = torch.empty_like(q_heads), torch.empty_like(k_heads)
        rms_norm(q, q_heads, q_norm_weight, eps)
        rms_norm(k, k_heads, k_norm_weight, eps)
        q, k = q.view(num_tokens, -1), k.view(num_tokens, -1)
    rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)
    key, value = k.view(num_tokens, num_kv_heads, head_size), v.view(num_tokens, num_kv_heads, head_size)
    reshape_and_cache(key, value, kv_cache, slot_mapping)
    return q, k


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16])  # 16: partial rotary
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_separate_ops(norm, is_neox, rotary_dim, dtype):
    case = Case(7, 4, 2, 32, rotary_dim, is_neox, norm, dtype, row_padding=8)
    args = make_inputs(case, torch.device("cpu"))
    separate = {**args, "qkv": args["qkv"].clone(), "kv_cache": args["kv_cache"].clone()}
    q, k = _separate_ops(**separate)
    rope_and_cache(**args)  # on CPU: the reference
    assert torch.equal(args["qkv"][:, : 4 * 32], q) and torch.equal(args["qkv"][:, 4 * 32 : 6 * 32], k)
    assert torch.equal(args["qkv"][:, 6 * 32 :], separate["qkv"][:, 6 * 32 :])  # v untouched
    assert torch.equal(args["kv_cache"], separate["kv_cache"])
    # Padding slots (-1) wrote nothing: two of the seven tokens left their cache rows alone.
    written = (args["kv_cache"][0] != SENTINEL).any(-1).any(-1)  # [num_blocks, block_size]
    assert int(written.sum()) == 5


def test_not_fused_on_cpu():
    assert not fused_rope_and_cache_available(torch.zeros(2, 8, dtype=torch.bfloat16))


@needs_triton
def test_triton_kernel_under_the_interpreter() -> None:
    run_interpreter_check("tests.kernels.triton_rope_and_cache_check")


GPU_CASES = [
    # Llama 3 8B per GPU: 32 query heads, 8 KV heads, head 128, neox, no QK-norm.
    *(Case(n, 32, 8, 128, 128, True, False, dtype, block_size=16) for n in (1, 37, 512) for dtype in (torch.bfloat16, torch.float16)),
    # Qwen3 (e.g. 4B): 16 / 8 heads of 128 with QK-norm; cos/sin in the model dtype, int32 positions.
    *(Case(n, 16, 8, 128, 128, True, True, dtype, block_size=16, cache_in_float32=False, positions_dtype=torch.int32)
      for n in (1, 37, 512) for dtype in (torch.bfloat16, torch.float16)),
    Case(9, 8, 2, 64, 32, False, True, torch.bfloat16, row_padding=64),  # GPT-J pairs, partial rotary, strided rows
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_triton_kernel_on_gpu(case):
    from shoal.kernels.triton.rope_and_cache import triton_rope_and_cache

    assert check(triton_rope_and_cache, case, torch.device("cuda")) == []


@pytest.mark.gpu
def test_fused_only_for_half_precision_on_gpu():
    assert fused_rope_and_cache_available(torch.zeros(2, 8, dtype=torch.bfloat16, device="cuda"))
    assert fused_rope_and_cache_available(torch.zeros(2, 8, dtype=torch.float16, device="cuda"))
    assert not fused_rope_and_cache_available(torch.zeros(2, 8, dtype=torch.float32, device="cuda"))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_models_fused_branch_equals_the_separate_ops(tiny_checkpoints, monkeypatch, kind):
    """The branch LlamaAttention takes on a GPU, run on CPU with the reference: same logits, bit
    for bit (Qwen3 passes its q/k norms; Attention skips its own cache write)."""
    sequences = [[3, 17, 5, 9, 11, 2, 8], [4, 1, 30, 6, 12]]
    steps = [[(0, 5), (0, 3)], [(5, 6), (3, 4)], [(6, 7), (4, 5)]]  # prefill, then two decodes

    def run() -> list[torch.Tensor]:
        model = load_shoal(tiny_checkpoints[kind], dtype="bfloat16")
        runner = PagedRunner(model, [len(s) for s in sequences], block_size=4)
        return [logits for chunks in steps for logits in runner.step(sequences, chunks)]

    separate = run()
    norms = []
    monkeypatch.setattr(llama_module, "fused_rope_and_cache_available", lambda qkv: True)
    monkeypatch.setattr(llama_module, "rope_and_cache", lambda *args: norms.append(args[-3:]) or rope_and_cache(*args))
    fused = run()
    assert len(norms) == len(steps) * 3  # every layer of the tiny model (3), every step
    assert all((q_norm is not None) == (kind == "qwen3") and (k_norm is not None) == (kind == "qwen3")
               for q_norm, k_norm, _ in norms)  # fmt: skip
    for ours, expected in zip(fused, separate, strict=True):
        assert torch.equal(ours, expected)
