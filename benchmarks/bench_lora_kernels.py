"""Time the dense layers' LoRA kernels on a GPU: the segment kernels (tokens sorted by slot, what
the LoRA layers run) against the per-token kernels (what they ran before, and what the MoE
experts' entries run), beside the base projection itself; prints a table and writes JSON.

    python3 benchmarks/bench_lora_kernels.py --output bench_lora_kernels.json
    TRITON_INTERPRET=1 python3 benchmarks/bench_lora_kernels.py --smoke   # CPU: the kernels agree

Shapes: Llama-3.1-8B's four adapted projections at tensor parallelism 1, bf16, rank 16 a slice
(qkv three slices, gate_up two), 8 adapters in slots, the tokens spread evenly over them; M = 1,
16, 64, 256 tokens. Each time is shrink + expand, the median over replays of a CUDA graph
(bench_kernels.py's `time_per_call`); `base` is F.linear of the projection at the same M, so
`lora / base` is the share the adapter adds to that product.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {  # name: (in features, out features, slices)
    "qkv": (4096, 6144, 3),
    "o": (4096, 4096, 1),
    "gate_up": (4096, 28672, 2),
    "down": (14336, 4096, 1),
}
SMOKE_SHAPES = {"qkv": (96, 144, 3), "down": (300, 64, 1)}
TOKENS = [1, 16, 64, 256]
RANK, NUM_SLOTS = 16, 8


def _timer(device: str) -> Callable[[Callable[[int], object]], float]:
    if device == "cuda":
        from bench_kernels import time_per_call

        return time_per_call

    def wall_ms(fn: Callable[[int], object]) -> float:  # the interpreter: a smoke run, not a figure
        start = time.perf_counter()
        fn(0)
        return (time.perf_counter() - start) * 1e3

    return wall_ms


def bench_shape(name: str, shape: tuple[int, int, int], num_tokens: int, device: str, dtype: torch.dtype) -> dict:
    from shoal.kernels.triton.lora import triton_lora_expand, triton_lora_shrink
    from shoal.kernels.triton.lora_segments import triton_lora_expand_segments, triton_lora_shrink_segments
    from shoal.lora.layers import TokenSlots

    in_size, out_size, slices = shape
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, in_size, generator=gen).to(dtype).to(device)
    weight = (torch.randn(out_size, in_size, generator=gen) * 0.02).to(dtype).to(device)
    lora_a = (torch.randn(NUM_SLOTS, slices * RANK, in_size, generator=gen) * 0.02).to(dtype).to(device)
    lora_b = (torch.randn(NUM_SLOTS, out_size, slices * RANK, generator=gen) * 0.02).to(dtype).to(device)
    slots = (torch.arange(num_tokens, dtype=torch.int32) % NUM_SLOTS).to(device)
    segments = TokenSlots.of(slots, NUM_SLOTS).segments
    y = F.linear(x, weight)

    def per_token(_: int) -> torch.Tensor:
        return triton_lora_expand(y, triton_lora_shrink(x, lora_a, slots), lora_b, slots)

    def by_segment(_: int) -> torch.Tensor:
        return triton_lora_expand_segments(y, triton_lora_shrink_segments(x, lora_a, segments), lora_b, segments)

    def fresh_output(kernel: Callable[[int], torch.Tensor]) -> torch.Tensor:
        y.copy_(F.linear(x, weight))  # the kernels add into y in place
        return kernel(0).float().clone()

    agree = torch.allclose(fresh_output(per_token), fresh_output(by_segment), rtol=2e-2, atol=2e-2)
    timer = _timer(device)
    times = {
        "base": timer(lambda _: F.linear(x, weight)),
        "per_token": timer(per_token),
        "segments": timer(by_segment),
    }
    row = {"shape": name, "tokens": num_tokens, "agree": agree, **{f"{k}_ms": v for k, v in times.items()}}
    row["segments_speedup"] = times["per_token"] / times["segments"]
    row["lora_over_base"] = times["segments"] / times["base"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        from tests.kernels.interpreter import prepare_interpreter

        prepare_interpreter()
    dtype = torch.float16 if args.smoke else torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    shapes, tokens = (SMOKE_SHAPES, [1, 20]) if args.smoke else (SHAPES, TOKENS)
    rows = [bench_shape(name, shape, m, device, dtype) for name, shape in shapes.items() for m in tokens]
    print(
        f"{'shape':8} {'tokens':>6} {'base ms':>9} {'per-token':>10} {'segments':>9} {'speed-up':>8} {'/base':>6} agree"
    )
    for r in rows:
        print(
            f"{r['shape']:8} {r['tokens']:>6} {r['base_ms']:>9.4f} {r['per_token_ms']:>10.4f} {r['segments_ms']:>9.4f}"
            f" {r['segments_speedup']:>7.2f}x {r['lora_over_base']:>6.2f} {r['agree']}"
        )
    if args.output:
        device_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (interpreter)"
        args.output.write_text(
            json.dumps({"device": device_name, "rank": RANK, "slots": NUM_SLOTS, "rows": rows}, indent=2)
        )
    return 0 if all(r["agree"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
