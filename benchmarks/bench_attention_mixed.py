"""Attention over a mixed batch (decode requests next to prefill chunks), as chunked prefill
schedules it: the decode requests through the decode kernel and the prefill chunks through the
unified kernel (`SPLIT_MIXED_BATCHES`, the default) against the whole batch through the unified
kernel. Each case also times its decode part alone (a decode-only batch) for the share of the
copy rate its context reads reach.

    python3 benchmarks/bench_attention_mixed.py --output mixed.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal.kernels.triton import paged_attention as tpa

BLOCK_SIZE = 16
# (name, query heads, KV heads, decode requests, their mean context, prefill chunks, chunk length)
CASES = [
    ("llama-8b 240 decodes ctx~1100 + 2 x 1024 prefill", 32, 8, 240, 1100, 2, 1024),
    ("llama-8b 128 decodes ctx~400 + 7 x 1024 prefill", 32, 8, 128, 400, 7, 1024),
    ("qwen3-0.6b 240 decodes ctx~800 + 2 x 1024 prefill", 16, 8, 240, 800, 2, 1024),
]


def make_batch(num_heads: int, num_kv_heads: int, num_decodes: int, mean_ctx: int, num_prefills: int, length: int):
    """Decode requests first (contexts uniform in [mean/2, 3 mean/2]), then fresh prompt chunks;
    every request's blocks scattered over one cache."""
    generator = torch.Generator().manual_seed(0)
    decode_lens = torch.randint(mean_ctx // 2, mean_ctx * 3 // 2 + 1, (num_decodes,), generator=generator)
    seq_lens = torch.cat([decode_lens, torch.full((num_prefills,), length)])
    query_lens = torch.cat([torch.ones(num_decodes, dtype=torch.int64), torch.full((num_prefills,), length)])
    blocks = [-(-int(n) // BLOCK_SIZE) for n in seq_lens]
    order = torch.randperm(sum(blocks) + 16, generator=generator)
    block_tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    used = 0
    for i, count in enumerate(blocks):
        block_tables[i, :count] = order[used : used + count].to(torch.int32)
        used += count
    device = torch.device("cuda")
    head_size = 128
    kv_cache = torch.randn(
        2, sum(blocks) + 16, BLOCK_SIZE, num_kv_heads, head_size, dtype=torch.bfloat16, device=device
    )
    query = torch.randn(int(query_lens.sum()), num_heads, head_size, dtype=torch.bfloat16, device=device)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)]).to(torch.int32)
    decode_kv_bytes = int(decode_lens.sum()) * num_kv_heads * head_size * 2 * 2
    return {
        "query": query,
        "kv_cache": kv_cache,
        "query_start_loc": query_start_loc.to(device),
        "seq_lens": seq_lens.to(torch.int32).to(device),
        "block_tables": block_tables.to(device),
        "max_query_len": int(query_lens.max()),
        "max_seq_len": int(seq_lens.max()),
        "num_decodes": num_decodes,
        "decode_kv_bytes": decode_kv_bytes,
    }


def time_us(batch: dict, split: bool, decodes_only: bool = False) -> float:
    n = batch["num_decodes"]
    query, qsl, seq_lens, tables = batch["query"], batch["query_start_loc"], batch["seq_lens"], batch["block_tables"]
    max_query_len, max_seq_len = batch["max_query_len"], batch["max_seq_len"]
    if decodes_only:
        query, qsl, seq_lens, tables = query[:n], qsl[: n + 1], seq_lens[:n], tables[:n]
        max_query_len, max_seq_len = 1, int(seq_lens.max())
    out = torch.empty_like(query)

    def run() -> None:
        tpa.triton_paged_attention(
            out, query, batch["kv_cache"], qsl, seq_lens, tables, max_query_len, max_seq_len, 0.088
        )

    default, tpa.SPLIT_MIXED_BATCHES = tpa.SPLIT_MIXED_BATCHES, split
    try:
        return 1e3 * triton.testing.do_bench(run, warmup=10, rep=50)
    finally:
        tpa.SPLIT_MIXED_BATCHES = default


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default="bench_attention_mixed.json")
    args = parser.parse_args()
    results = []
    for name, *shape in CASES:
        batch = make_batch(*shape)
        result = {
            "case": name,
            "unified_us": time_us(batch, split=False),
            "split_us": time_us(batch, split=True),
            "decodes_alone_us": time_us(batch, split=True, decodes_only=True),
            "decode_kv_bytes": batch["decode_kv_bytes"],
        }
        result["decodes_alone_tb_per_s"] = batch["decode_kv_bytes"] / result["decodes_alone_us"] / 1e6
        results.append(result)
        print(
            f"{name}: whole batch unified {result['unified_us']:.1f} us, decodes split off "
            f"{result['split_us']:.1f} us; decodes alone {result['decodes_alone_us']:.1f} us "
            f"({result['decodes_alone_tb_per_s']:.2f} TB/s)"
        )
        del batch
        torch.cuda.empty_cache()
    Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
