"""Sweep the Triton attention kernels' launch parameters on the shapes the engine runs.

Decode: each case is a decode batch over a paged cache with scattered blocks and context lengths
drawn around a mean (as in a running engine); every (block_n, num_warps, num_stages,
programs_per_sm, split_below_per_sm) setting is timed with `triton.testing.do_bench` and reported with its achieved
bandwidth. Unified (`--kernel unified`): prefill batches of fresh prompts (a step of
max_num_batched_tokens), reported in TFLOP/s of causal attention. Prints the best settings per
case and over all cases, and writes everything as JSON.

    python3 benchmarks/sweep_attention.py --output sweep.json [--kernel unified]

`--kernel order`: the decode cases with their requests as drawn, longest context first and
shortest first (the kernel runs programs in request order, so the order decides which long
contexts are left for the last wave).

`--kernel splits`: small decode batches (batch 1 to 32) at contexts from 128 to 4,096 with the
context split in 1, 2, 4, 8 or 16 parts and as `choose_num_splits` picks, each timed inside a
CUDA graph (as the engine replays decode steps, so the reduce kernel costs its in-graph launch).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal.kernels.triton import paged_attention as tpa

BLOCK_SIZE = 16
# (name, query heads, KV heads, batch, mean context, max_seq_len the graph was captured with)
CASES = [
    ("qwen3-0.6b b256 ctx~800", 16, 8, 256, 800, 4096),
    ("qwen3-0.6b b64 ctx~800", 16, 8, 64, 800, 4096),
    ("llama-8b b256 ctx~800", 32, 8, 256, 800, 4096),
    ("llama-8b b1 ctx 400", 32, 8, 1, 400, 4096),
    ("llama-8b b1 ctx 4000", 32, 8, 1, 4000, 4096),
]
GRID = {
    "block_n": (32, 64, 128),
    "num_warps": (2, 4),
    "num_stages": (2, 3, 4),
    "programs_per_sm": (4, 16),
    "split_below_per_sm": (4, 16),
}
# (name, query heads, KV heads, prompts, prompt length): one prefill step of 8192 tokens
UNIFIED_CASES = [
    ("llama-8b 8 x 1024", 32, 8, 8, 1024),
    ("qwen3-0.6b 16 x 512", 16, 8, 16, 512),
]
UNIFIED_GRID = {"block_m": (64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3)}


def make_case(
    num_heads: int,
    num_kv_heads: int,
    batch: int,
    mean_ctx: int,
    cache_gib: float = 0.0,
    head_size: int = 128,
    ctx_range: tuple[int, int] | None = None,
):
    generator = torch.Generator().manual_seed(0)
    low, high = ctx_range or (max(1, mean_ctx // 2), mean_ctx * 3 // 2)
    seq_lens = torch.randint(low, high + 1, (batch,), generator=generator) if batch > 1 else torch.tensor([mean_ctx])
    blocks_per_req = -(-int(seq_lens.max()) // BLOCK_SIZE)
    num_blocks = int(sum(-(-int(n) // BLOCK_SIZE) for n in seq_lens)) + 16
    # A cache as large as an engine's (cache_gib), the batch's blocks scattered over all of it.
    block_bytes = 2 * BLOCK_SIZE * num_kv_heads * head_size * 2
    num_blocks = max(num_blocks, int(cache_gib * 2**30 / block_bytes))
    order = torch.randperm(num_blocks, generator=generator)  # scattered blocks, as after churn
    block_tables = torch.zeros(batch, blocks_per_req, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens.tolist()):
        count = -(-n // BLOCK_SIZE)
        block_tables[i, :count] = order[used : used + count].to(torch.int32)
        used += count
    device = torch.device("cuda")
    kv_cache = torch.empty(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size, dtype=torch.bfloat16, device=device)
    kv_cache.normal_()
    query = torch.randn(batch, num_heads, head_size, dtype=torch.bfloat16, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    kv_bytes = int(seq_lens.sum()) * num_kv_heads * head_size * 2 * 2
    return query, kv_cache, query_start_loc, seq_lens.to(torch.int32).to(device), block_tables.to(device), kv_bytes


def make_prefill(num_heads: int, num_kv_heads: int, num_prompts: int, length: int, head_size: int = 128):
    device = torch.device("cuda")
    num_tokens = num_prompts * length
    blocks_per_req = -(-length // BLOCK_SIZE)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(num_prompts * blocks_per_req + 16, generator=generator)[: num_prompts * blocks_per_req]
    block_tables = order.view(num_prompts, blocks_per_req).to(torch.int32).to(device)
    kv_cache = torch.randn(
        2, num_prompts * blocks_per_req + 16, BLOCK_SIZE, num_kv_heads, head_size, dtype=torch.bfloat16, device=device
    )
    query = torch.randn(num_tokens, num_heads, head_size, dtype=torch.bfloat16, device=device)
    query_start_loc = torch.arange(0, num_tokens + 1, length, dtype=torch.int32, device=device)
    seq_lens = torch.full((num_prompts,), length, dtype=torch.int32, device=device)
    flops = 4 * num_prompts * (length * (length + 1) // 2) * num_heads * head_size
    return query, kv_cache, query_start_loc, seq_lens, block_tables, flops


def time_settings(case: str, grid: dict, tuning: str, run: functools.partial, work: float, unit: str) -> dict:
    """Time the kernel `run` launches under every setting of `grid` (the module attribute
    `tuning` of tpa holds it meanwhile); rank them, print the best five, and return the case's
    result with each setting's rate in `unit` (`work` per second / 1e12)."""
    default = getattr(tpa, tuning)
    timings = []
    for values in itertools.product(*grid.values()):
        setting = dict(zip(grid, values))
        setattr(tpa, tuning, type(default)(**setting))
        try:
            ms = triton.testing.do_bench(run, warmup=5, rep=20)
        except Exception as error:  # e.g. out of shared memory for a large tile
            print(f"{case} {values}: {type(error).__name__}")
            continue
        timings.append({"tuning": setting, "us": 1e3 * ms, unit: work / ms / 1e9})
    setattr(tpa, tuning, default)
    timings.sort(key=lambda t: t["us"])
    base = next(t for t in timings if t["tuning"] == vars(default))
    print(f"{case}: default {base['us']:.1f} us ({base[unit]:.2f} {unit})")
    for t in timings[:5]:
        print(f"   {t['us']:8.1f} us  {t[unit]:.2f} {unit}  {t['tuning']}")
    return {"case": case, "default": base, "ranked": timings}


def sweep_decode(output: str, cache_gib: float) -> None:
    results = []
    for name, num_heads, num_kv_heads, batch, mean_ctx, max_seq_len in CASES:
        query, kv_cache, qsl, seq_lens, block_tables, kv_bytes = make_case(
            num_heads, num_kv_heads, batch, mean_ctx, cache_gib
        )
        out = torch.empty_like(query)
        run = functools.partial(
            tpa.triton_paged_attention, out, query, kv_cache, qsl, seq_lens, block_tables, 1, max_seq_len, 0.088
        )
        result = time_settings(name, GRID, "DECODE_TUNING", run, kv_bytes, "tb_per_s")
        results.append({**result, "kv_bytes": kv_bytes})
        del query, kv_cache, out, run  # before the next case allocates its own cache
        torch.cuda.empty_cache()
    Path(output).write_text(json.dumps(results, indent=1))
    print_overall(results)


def sweep_unified(output: str) -> None:
    results = []
    for name, num_heads, num_kv_heads, num_prompts, length in UNIFIED_CASES:
        query, kv_cache, qsl, seq_lens, block_tables, flops = make_prefill(num_heads, num_kv_heads, num_prompts, length)
        out = torch.empty_like(query)
        run = functools.partial(
            tpa.triton_paged_attention, out, query, kv_cache, qsl, seq_lens, block_tables, length, length, 0.088
        )
        results.append({**time_settings(name, UNIFIED_GRID, "UNIFIED_TUNING", run, flops, "tflops"), "flops": flops})
    Path(output).write_text(json.dumps(results, indent=1))
    print_overall(results)


# (name, query heads, KV heads, batch, context range, max_seq_len): the nano-vllm protocol's
# decode batches hold contexts from ~100 to ~2,048 tokens
ORDER_CASES = [
    (name, heads, kv_heads, batch, (mean // 2, mean * 3 // 2), max_len)
    for name, heads, kv_heads, batch, mean, max_len in CASES
    if batch > 1
] + [
    ("qwen3-0.6b b256 ctx 100-2048", 16, 8, 256, (100, 2048), 4096),
    ("llama-8b b256 ctx 100-2048", 32, 8, 256, (100, 2048), 4096),
]


def sweep_order(output: str, cache_gib: float) -> None:
    results = []
    for name, num_heads, num_kv_heads, batch, ctx_range, max_seq_len in ORDER_CASES:
        query, kv_cache, qsl, seq_lens, block_tables, kv_bytes = make_case(
            num_heads, num_kv_heads, batch, 0, cache_gib, ctx_range=ctx_range
        )
        out = torch.empty_like(query)
        timings = {}
        orders = {
            "as drawn": torch.arange(batch, device=seq_lens.device),
            "longest first": torch.argsort(seq_lens, descending=True),
            "shortest first": torch.argsort(seq_lens),
        }
        default = tpa.DECODE_TUNING
        for (label, order), heads_fastest in itertools.product(orders.items(), (False, True)):
            tpa.DECODE_TUNING = dataclasses.replace(default, heads_fastest=heads_fastest)
            args = (out, query[order], kv_cache, qsl, seq_lens[order], block_tables[order], 1, max_seq_len, 0.088)
            ms = triton.testing.do_bench(functools.partial(tpa.triton_paged_attention, *args), warmup=10, rep=50)
            label = f"{label}, {'heads' if heads_fastest else 'requests'} fastest"
            timings[label] = {"us": 1e3 * ms, "tb_per_s": kv_bytes / ms / 1e9}
        tpa.DECODE_TUNING = default
        print(name)
        for label, t in timings.items():
            print(f"   {label:40s} {t['us']:7.1f} us  {t['tb_per_s']:.2f} TB/s")
        results.append({"case": name, "kv_bytes": kv_bytes, "by_order": timings})
        del query, kv_cache, out, args  # args holds the cache too: free it before the next case's
        torch.cuda.empty_cache()
    Path(output).write_text(json.dumps(results, indent=1))


SPLIT_CASES = [(batch, ctx) for batch in (1, 8, 32) for ctx in (128, 384, 640, 1024, 2048, 4096)]


def sweep_splits(output: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_kernels import time_per_call

    results = []
    for batch, ctx in SPLIT_CASES:
        query, kv_cache, qsl, seq_lens, block_tables, kv_bytes = make_case(32, 8, batch, ctx)
        seq_lens.fill_(ctx)
        out = torch.empty_like(query)
        timings = {}
        for splits in (0, 1, 2, 4, 8, 16):  # 0: the kernel's own choice for a graph captured at 4,096
            run = functools.partial(
                tpa.triton_paged_attention, out, query, kv_cache, qsl, seq_lens, block_tables, 1, 4096, 0.088, splits
            )
            timings[splits] = 1e3 * time_per_call(lambda i, run=run: run())
        best = min(timings, key=timings.get)
        print(
            f"llama-8b b{batch} ctx {ctx}: "
            + ", ".join(f"{k}: {v:.1f}" for k, v in timings.items())
            + f" us; best {best}"
        )
        results.append({"batch": batch, "ctx": ctx, "us_by_splits": timings, "kv_bytes": kv_bytes})
    Path(output).write_text(json.dumps(results, indent=1))


def print_overall(results: list[dict]) -> None:
    """One setting for every case: the best mean of times relative to each case's best."""
    scores: dict[str, float] = {}
    for result in results:
        best = result["ranked"][0]["us"]
        for t in result["ranked"]:
            key = json.dumps(t["tuning"], sort_keys=True)
            scores[key] = scores.get(key, 0.0) + t["us"] / best
    for key, score in sorted(scores.items(), key=lambda kv: kv[1])[:5]:
        print(f"overall {score / len(results):.3f} x best: {key}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output", default="sweep_decode_attention.json")
    parser.add_argument("--kernel", choices=("decode", "unified", "splits", "order"), default="decode")
    parser.add_argument(
        "--cache-gib", type=float, default=0.0, help="decode: spread the blocks over a cache this large (TLB effects)"
    )
    args = parser.parse_args()
    if args.kernel == "unified":
        sweep_unified(args.output)
    elif args.kernel == "splits":
        sweep_splits(args.output)
    elif args.kernel == "order":
        sweep_order(args.output, args.cache_gib)
    else:
        sweep_decode(args.output, args.cache_gib)


if __name__ == "__main__":
    main()
