"""Causal prefill attention of fresh prompts: shoal's unified Triton kernel (reading K and V
through the paged cache, as the engine does) against PyTorch's own flash attention on the same
prompts held contiguously (`scaled_dot_product_attention` on a padding-free [prompts, heads,
length, head_size] batch, and `torch.nn.attention.varlen.varlen_attn` on the packed tokens where
this torch has it). Reported in TFLOP/s of causal attention, to decide whether fresh prompts
should leave the paged kernel.

    python3 benchmarks/bench_prefill_attention.py --output prefill_attention.json
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sweep_attention import make_prefill

from shoal.kernels.triton import paged_attention as tpa

# (name, query heads, KV heads, prompts, prompt length)
CASES = [
    ("llama-8b 8 x 1024", 32, 8, 8, 1024),
    ("llama-8b 2 x 1024", 32, 8, 2, 1024),
    ("llama-8b 2 x 4096", 32, 8, 2, 4096),
    ("qwen3-0.6b 16 x 512", 16, 8, 16, 512),
]
HEAD_SIZE = 128


def contiguous_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' keys and values gathered out of the paged cache: [prompts, length, kv heads, head_size]."""
    keys = kv_cache[0][block_tables.long()].flatten(1, 2)[:, :length]
    values = kv_cache[1][block_tables.long()].flatten(1, 2)[:, :length]
    return keys.contiguous(), values.contiguous()


def time_us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=50)


def bench_case(num_heads: int, num_kv_heads: int, num_prompts: int, length: int) -> dict:
    query, kv_cache, qsl, seq_lens, block_tables, flops = make_prefill(num_heads, num_kv_heads, num_prompts, length)
    scale = HEAD_SIZE**-0.5
    out = torch.empty_like(query)
    shoal_run = functools.partial(
        tpa.triton_paged_attention, out, query, kv_cache, qsl, seq_lens, block_tables, length, length, scale
    )
    keys, values = contiguous_kv(kv_cache, block_tables, length)
    q = query.view(num_prompts, length, num_heads, HEAD_SIZE).transpose(1, 2)
    k, v = keys.transpose(1, 2), values.transpose(1, 2)  # [prompts, kv heads, length, head_size]

    def sdpa_run() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    reference = sdpa_run().transpose(1, 2).reshape_as(query)
    shoal_run()
    result = {
        "flops": flops,
        "max_abs_diff_vs_sdpa": (out.float() - reference.float()).abs().max().item(),
        "us": {"shoal_unified": time_us(shoal_run), "sdpa": time_us(sdpa_run)},
    }
    varlen = _varlen_attn()
    if varlen is not None:
        timings, diffs = _time_varlen(
            varlen, query, keys, values, kv_cache, qsl, block_tables, length, scale, reference
        )
        result["us"].update(timings)
        result.update(diffs)
    result["tflops"] = {name: flops / us / 1e6 for name, us in result["us"].items()}
    return result


def _time_varlen(
    varlen, query, keys, values, kv_cache, qsl, block_tables, length, scale, reference
) -> tuple[dict, dict]:
    """varlen_attn on the packed tokens, and on the paged cache where this torch takes a block
    table (its keywords changed between releases: is_causal, then window_size and enable_gqa);
    their times, and each output's largest difference from SDPA's."""
    params = inspect.signature(varlen).parameters
    options = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    num_heads, num_kv_heads = query.shape[1], keys.shape[2]
    k_packed, v_packed = keys.flatten(0, 1), values.flatten(0, 1)
    if "enable_gqa" in params:
        options["enable_gqa"] = True
    else:  # no GQA: the heads repeated to the query's count
        group = num_heads // num_kv_heads
        k_packed, v_packed = (t.repeat_interleave(group, dim=1) for t in (k_packed, v_packed))
    cu = qsl.to(torch.int32)
    if "scale" in params:  # older releases take none and use head_size ** -0.5, as here
        options["scale"] = scale
    runs = {"varlen_attn": lambda: varlen(query, k_packed, v_packed, cu, cu, length, length, **options)}
    if "block_table" in params and "enable_gqa" in params:
        seq_lens = torch.full((block_tables.shape[0],), length, dtype=torch.int32, device=query.device)
        runs["varlen_attn_paged"] = lambda: varlen(
            query, kv_cache[0], kv_cache[1], cu, None, length, length,
            seqused_k=seq_lens, block_table=block_tables, **options,
        )  # fmt: skip
    timings, diffs = {}, {}
    for name, run in runs.items():
        try:
            diffs[f"max_abs_diff_{name}_vs_sdpa"] = (run().float() - reference.float()).abs().max().item()
            timings[name] = time_us(run)
        except (TypeError, RuntimeError) as error:
            print(f"   {name}: {type(error).__name__}: {error}")
    return timings, diffs


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default="bench_prefill_attention.json")
    args = parser.parse_args()
    results = []
    for name, *shape in CASES:
        try:
            result = {"case": name, **bench_case(*shape)}
        except Exception as error:  # one backend's gap must not lose the other cases
            result = {"case": name, "error": f"{type(error).__name__}: {error}"}
        results.append(result)
        rates = ", ".join(f"{k} {v:.0f}" for k, v in result.get("tflops", {}).items())
        print(f"{name}: {rates or result['error']} TFLOP/s")
        torch.cuda.empty_cache()
    Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
