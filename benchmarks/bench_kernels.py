"""Benchmark shoal's GPU kernels on Llama-3.1-8B shapes; prints a table and writes JSON.

    python3 benchmarks/bench_kernels.py --output bench_kernels.json [--quick]

1. Paged decode attention (32 query heads, 8 KV heads, head_dim 128, bf16, block_size 16, each
   request's blocks scattered through the cache): achieved bandwidth (KV bytes read / time) as
   a share of the H200's 4.26 TB/s copy bandwidth, for the csrc kernel (split-K chosen by the
   kernel, and forced off), the Triton decode kernel and the Triton unified kernel, which would
   serve decode if one kernel did everything. This is what picks DECODE_KERNEL in
   shoal/kernels/paged_attention.py.
2. fp8 GEMM: cutlass_scaled_mm (per-token x per-channel scales) against torch.matmul in bf16 and
   torch._scaled_mm (same scales, fast accumulation), in TFLOP/s and weight-read GB/s, for the
   Llama-3.1-8B projections at M from 1 to 4096.

Every time is the median over replays of a CUDA graph holding several calls (launch overhead
excluded, as in a graph-captured decode step); weights rotate through enough copies to exceed
the L2 cache, so small-M GEMMs read them from HBM as in a real forward pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from shoal.kernels import _C

PEAK_BANDWIDTH_BYTES = 4.26e12  # H200 device-to-device copy, measured (shared/device/README.md)
L2_FLUSH_BYTES = 256 << 20  # rotate weights through at least this much memory (L2 is 50 MB)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
GEMM_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
GEMM_MS = [1, 16, 64, 256, 1024, 4096]


def time_per_call(fn: Callable[[int], object], calls: int = 20, replays: int = 10) -> float:
    """Median milliseconds per call of fn(i), i = 0..calls-1, captured in one CUDA graph (or,
    if capture fails, launched eagerly, launch overhead included)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (Triton compiles here) off the capture
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
    except RuntimeError as error:
        print(f"graph capture failed ({str(error).splitlines()[0]}); timing eager launches")
        graph = None
        torch.cuda.synchronize()

    def run() -> None:
        if graph is not None:
            graph.replay()
        else:
            for i in range(calls):
                fn(i)

    run()  # the first replay uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


# --- paged decode attention --------------------------------------------------------------------


def _decode_batch(batch: int, context: int) -> dict[str, torch.Tensor]:
    """A decode step of `batch` requests with `context` tokens each, blocks shuffled."""
    blocks_per_req = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    return {
        "query": torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
        "kv_cache": kv_cache,
        "query_start_loc": torch.arange(batch + 1, device="cuda", dtype=torch.int32),
        "seq_lens": torch.full((batch,), context, device="cuda", dtype=torch.int32),
        "block_tables": perm.view(batch, blocks_per_req),
    }


def _attention_kernels() -> dict[str, Callable[..., object]]:
    """name -> fn(out, query, kv_cache, query_start_loc, seq_lens, block_tables, max_seq_len)."""
    kernels: dict[str, Callable[..., object]] = {}
    if _C.load():
        op = torch.ops.shoal.paged_attention
        kernels["csrc"] = lambda out, q, kv, qsl, sl, bt, n: op(out, q, kv, qsl, sl, bt, 1, n, HEAD_DIM**-0.5, 0)
        kernels["csrc_no_split"] = lambda out, q, kv, qsl, sl, bt, n: op(
            out, q, kv, qsl, sl, bt, 1, n, HEAD_DIM**-0.5, 1
        )
    from shoal.kernels.triton.paged_attention import _unified_attention, triton_paged_attention

    kernels["triton"] = lambda out, q, kv, qsl, sl, bt, n: triton_paged_attention(
        out, q, kv, qsl, sl, bt, 1, n, HEAD_DIM**-0.5
    )
    kernels["triton_unified"] = lambda out, q, kv, qsl, sl, bt, n: _unified_attention(
        out, q, kv, qsl, sl, bt, HEAD_DIM**-0.5
    )
    return kernels


def _bench_attention_case(
    batch: int, context: int, kernels: dict[str, Callable[..., object]]
) -> list[dict[str, object]]:
    inputs = _decode_batch(batch, context)
    args = [inputs[k] for k in ("query", "kv_cache", "query_start_loc", "seq_lens", "block_tables")]
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2  # keys and values, bf16
    rows, outputs = [], {}
    for name, kernel in kernels.items():
        out = torch.empty_like(inputs["query"])
        ms = time_per_call(lambda i, kernel=kernel, out=out: kernel(out, *args, context))
        outputs[name] = out
        bandwidth = kv_bytes / (ms * 1e-3)
        rows.append(
            {
                "batch": batch,
                "context": context,
                "kernel": name,
                "ms": ms,
                "gb_per_s": bandwidth / 1e9,
                "share_of_peak": bandwidth / PEAK_BANDWIDTH_BYTES,
            }
        )
    reference = next(iter(outputs.values())).float()  # sanity: every kernel computes the same thing
    for row in rows:
        row["max_abs_diff_vs_first"] = (outputs[row["kernel"]].float() - reference).abs().max().item()
    return rows


def bench_attention(batches: list[int], contexts: list[int]) -> list[dict[str, object]]:
    kernels = _attention_kernels()
    results = []
    for batch in batches:
        for context in contexts:
            results += _bench_attention_case(batch, context, kernels)
            torch.cuda.empty_cache()
    return results


# --- fp8 GEMM ----------------------------------------------------------------------------------


def _gemm_operands(m: int, n: int, k: int) -> dict[str, list[torch.Tensor] | torch.Tensor]:
    """Activations, weights (as enough copies to defeat L2) and scales of one GEMM."""
    copies = max(1, min(16, -(-L2_FLUSH_BYTES // (n * k))))  # fp8 bytes per weight copy: n * k
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]  # [N, K]
    return {
        "a_bf16": a,
        "a_fp8": a.to(torch.float8_e4m3fn),
        "w_bf16": weights,
        "w_fp8": [w.to(torch.float8_e4m3fn) for w in weights],
        "a_scale": torch.rand(m, 1, device="cuda") + 0.5,  # per token
        "b_scale": torch.rand(1, n, device="cuda") + 0.5,  # per output channel
        "out": torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
    }


def _gemm_impls(ops: dict) -> dict[str, Callable[[int], object]]:
    w_bf16, w_fp8, out = ops["w_bf16"], ops["w_fp8"], ops["out"]
    a_scale_flat, b_scale_flat = ops["a_scale"].reshape(-1), ops["b_scale"].reshape(-1)
    impls: dict[str, Callable[[int], object]] = {
        "torch_bf16": lambda i: torch.matmul(ops["a_bf16"], w_bf16[i % len(w_bf16)].t(), out=out),
        "torch_scaled_mm": lambda i: torch._scaled_mm(
            ops["a_fp8"],
            w_fp8[i % len(w_fp8)].t(),
            scale_a=ops["a_scale"],
            scale_b=ops["b_scale"],
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        ),
    }
    if _C.load():
        op = torch.ops.shoal.cutlass_scaled_mm
        impls["cutlass_scaled_mm"] = lambda i: op(
            out, ops["a_fp8"], w_fp8[i % len(w_fp8)].t(), a_scale_flat, b_scale_flat, None
        )
    return impls


def bench_gemm(ms_list: list[int], shapes: dict[str, tuple[int, int]]) -> list[dict[str, object]]:
    results = []
    for name, (n, k) in shapes.items():
        for m in ms_list:
            ops = _gemm_operands(m, n, k)
            for impl, fn in _gemm_impls(ops).items():
                row: dict[str, object] = {"gemm": name, "m": m, "n": n, "k": k, "impl": impl}
                try:
                    ms = time_per_call(fn)
                except RuntimeError as error:  # e.g. a torch build without rowwise _scaled_mm
                    row["error"] = str(error).splitlines()[0]
                    results.append(row)
                    continue
                weight_bytes = n * k * (2 if impl == "torch_bf16" else 1)
                row.update(
                    ms=ms,
                    tflops=2 * m * n * k / (ms * 1e-3) / 1e12,
                    weight_gb_per_s=weight_bytes / (ms * 1e-3) / 1e9,
                )
                results.append(row)
            del ops
            torch.cuda.empty_cache()
    return results


def print_tables(attention: list[dict[str, object]], gemm: list[dict[str, object]]) -> None:
    print("\npaged decode attention (Llama-3.1-8B, bf16): share of 4.26 TB/s")
    kernels = list(dict.fromkeys(str(r["kernel"]) for r in attention))
    print(f"{'batch':>6} {'context':>8} " + " ".join(f"{k:>16}" for k in kernels))
    for key in dict.fromkeys((r["batch"], r["context"]) for r in attention):
        cells = {r["kernel"]: r for r in attention if (r["batch"], r["context"]) == key}
        print(
            f"{key[0]:>6} {key[1]:>8} "
            + " ".join(f"{cells[k]['share_of_peak']:>9.1%} {cells[k]['ms']:>5.3f}ms" for k in kernels)
        )
    print("\nfp8 GEMM (Llama-3.1-8B projections): TFLOP/s (weight GB/s)")
    impls = list(dict.fromkeys(str(r["impl"]) for r in gemm))
    print(f"{'gemm':>8} {'m':>5} " + " ".join(f"{i:>24}" for i in impls))
    for key in dict.fromkeys((r["gemm"], r["m"]) for r in gemm):
        cells = {r["impl"]: r for r in gemm if (r["gemm"], r["m"]) == key}
        text = []
        for impl in impls:
            row = cells.get(impl, {})
            text.append(
                f"{'error':>24}" if "ms" not in row else f"{row['tflops']:>9.1f} ({row['weight_gb_per_s']:>6.0f} GB/s)"
            )
        print(f"{key[0]:>8} {key[1]:>5} " + " ".join(f"{t:>24}" for t in text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("bench_kernels.json"))
    parser.add_argument("--quick", action="store_true", help="one attention and two GEMM shapes (smoke test)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.quick:
        attention = bench_attention([64], [1024])
        gemm = bench_gemm([16, 1024], {"o": GEMM_SHAPES["o"]})
    else:
        attention = bench_attention([64, 256], [1024, 4096])
        gemm = bench_gemm(GEMM_MS, GEMM_SHAPES)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "csrc_loaded": _C.load(),
        "peak_bandwidth_tb_per_s": PEAK_BANDWIDTH_BYTES / 1e12,
        "paged_attention": attention,
        "scaled_mm": gemm,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print_tables(attention, gemm)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
