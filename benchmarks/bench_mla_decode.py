"""Benchmark the latent (MLA) decode kernel at DeepSeek's shapes; prints a table, writes JSON.

    python3 benchmarks/bench_mla_decode.py --output bench_mla_decode.json [--quick]

For each shape (requests x context, heads; latent 512 + 64, bf16, blocks of 16 scattered through
the cache) it times the default launch (`default_launch` in shoal/kernels/triton/mla_decode.py)
and, without --quick, a sweep of heads a program, latents a tile, warps and stages, then of split
counts, each checked against the default launch's output. Bandwidth is the latents read / time, as a share of the
device's streaming-read rate (shoal/bench/stream_read.py) measured in the same run. Times are
medians over replays of a CUDA graph (`time_per_call` of benchmarks/bench_kernels.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_kernels import time_per_call
from shoal.bench.hardware import measure_ceilings
from shoal.kernels.triton.mla_decode import MLADecodeLaunch, default_launch, triton_mla_decode

KV_LORA_RANK, ROPE_DIM, BLOCK_SIZE = 512, 64, 16
# (requests, context, heads): DeepSeek-V2-Lite (16 heads; V3 at TP=8 alike) and V3 on one GPU (128).
SHAPES = [(256, 768, 16), (256, 2048, 16), (64, 4096, 16), (8, 8192, 16), (256, 768, 128), (32, 4096, 128)]


def decode_inputs(num_reqs: int, context: int, num_heads: int) -> dict:
    blocks_per_req = triton.cdiv(context, BLOCK_SIZE)
    num_blocks = num_reqs * blocks_per_req
    latent = KV_LORA_RANK + ROPE_DIM
    kwargs = {"device": "cuda", "dtype": torch.bfloat16}
    return {
        "query": torch.randn(num_reqs, num_heads, latent, **kwargs),
        "kv_cache": torch.randn(1, num_blocks, BLOCK_SIZE, 1, latent, **kwargs),
        "block_tables": torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(num_reqs, blocks_per_req),
        "seq_lens": torch.full((num_reqs,), context, device="cuda", dtype=torch.int32),
        "max_seq_len": context,
        "scale": 576**-0.5,
    }


def sweep(num_heads: int) -> list[tuple[MLADecodeLaunch, int]]:
    """(launch, split count) pairs: tile shapes with the kernel's own split count (0), then the
    default launch over split counts (a grid of a few programs an SM leaves a partial last wave)."""
    block_hs = [h for h in (16, 32, 64) if h <= max(16, triton.next_power_of_2(num_heads))]
    grid = itertools.product(block_hs, (16, 32, 64), (4, 8), (1, 2, 3))
    tiles = [(MLADecodeLaunch(h, n, w, s), 0) for h, n, w, s in grid]
    return tiles + [(default_launch(num_heads), splits) for splits in (1, 2, 3, 4, 6, 8)]


def bench_shape(num_reqs: int, context: int, num_heads: int, read_bytes_per_s: float, quick: bool) -> dict:
    inputs = decode_inputs(num_reqs, context, num_heads)
    latent_bytes = num_reqs * context * (KV_LORA_RANK + ROPE_DIM) * 2
    reference = inputs["query"].new_empty(num_reqs, num_heads, KV_LORA_RANK)
    triton_mla_decode(reference, **inputs)
    out = torch.empty_like(reference)
    rows = []
    for launch, splits in [(default_launch(num_heads), 0)] + ([] if quick else sweep(num_heads)):
        try:
            ms = time_per_call(lambda i, la=launch, n=splits: triton_mla_decode(out, **inputs, num_splits=n, launch=la))
        except Exception as error:  # out of registers or shared memory: not a candidate
            print(f"  {launch} splits={splits}: {type(error).__name__}")
            continue
        share = latent_bytes / (ms * 1e-3) / read_bytes_per_s
        max_diff = (out.float() - reference.float()).abs().max().item()
        row = {"launch": launch.__dict__, "num_splits": splits, "us": ms * 1e3, "share_of_read_rate": share}
        rows.append({**row, "max_diff": max_diff})
    default, best = rows[0], min(rows, key=lambda row: row["us"])
    print(
        f"{num_reqs:4d} x {context:5d}, {num_heads:3d} heads: default {default['us']:7.1f} us "
        f"({default['share_of_read_rate']:.0%} of read), best {best['us']:7.1f} us "
        f"({best['share_of_read_rate']:.0%}) {best['launch']} splits={best['num_splits'] or 'auto'}"
    )
    return {"requests": num_reqs, "context": context, "heads": num_heads, "default": default, "best": best, "all": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True)
    parser.add_argument("--quick", action="store_true", help="the default launch only")
    args = parser.parse_args()
    ceilings = measure_ceilings("cuda")
    print(f"read {ceilings.read_bytes_per_s / 1e12:.2f} TB/s on {ceilings.device_name}")
    results = [bench_shape(*shape, ceilings.read_bytes_per_s, args.quick) for shape in SHAPES]
    Path(args.output).write_text(json.dumps({"ceilings": ceilings.as_dict(), "shapes": results}, indent=1))


if __name__ == "__main__":
    main()
