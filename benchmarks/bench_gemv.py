"""Benchmark the Triton gemv kernel against F.linear (cuBLAS) at decode batch sizes; prints a
table and writes JSON. This is what sets `use_gemv` in shoal/kernels/gemv.py.

    python3 benchmarks/bench_gemv.py --output bench_gemv.json
    python3 benchmarks/bench_gemv.py --sweep --output sweep_gemv.json

Shapes: the projections of Llama-3.1-8B (qkv, o, gate_up, down, LM head) and Qwen3-0.6B (qkv,
o, gate_up, down), bf16, M = 1, 2, 4, 8 rows. Each time is the median over replays of a CUDA
graph holding several calls, with the weights rotating through enough copies to exceed the L2
cache (bench_kernels.py's `time_per_call`), so they are read from HBM as in a forward pass. The
report gives microseconds per call, the achieved bandwidth of the weight read (TB/s and share of
the H200's 4.26 TB/s copy bandwidth) and the speed-up of gemv over F.linear.

`--sweep` times a grid of GemvTuning values on Llama-3.1-8B's qkv and o shapes (or --shapes;
--grid replaces a field's values; M = 1 unless --m says otherwise) and prints the best settings:

    python3 benchmarks/bench_gemv.py --sweep --shapes "llama-8b down" --grid programs_per_sm=0
    python3 benchmarks/bench_gemv.py --sweep --swiglu --shapes "llama-8b down"   # silu_and_mul fused
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_kernels, also under python -m

from bench_kernels import L2_FLUSH_BYTES, PEAK_BANDWIDTH_BYTES, time_per_call

SHAPES = {  # (N, K) of each projection's weight, tensor parallelism 1
    "llama-8b": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    },
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
}
MS = [1, 2, 4, 8]
SWEEP_SHAPES = {f"llama-8b {name}": shape for name, shape in SHAPES["llama-8b"].items()}
DEFAULT_SWEEP_SHAPES = ["llama-8b qkv", "llama-8b o"]
SWEEP_GRID = {
    "block_n": (4, 8, 16),
    "block_k": (256, 512, 1024),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4),
    "programs_per_sm": (0, 4),
}
DTYPE = torch.bfloat16


class Operands:
    """x [m, k], the weight [n, k] as enough copies to defeat L2, and an output; fn(i) uses copy i."""

    def __init__(self, m: int, n: int, k: int, swiglu: bool = False):
        self.m, self.n, self.k = m, n, k
        self.gate_up = torch.randn(m, 2 * k, device="cuda", dtype=DTYPE) if swiglu else None
        self.weight_bytes = n * k * DTYPE.itemsize
        copies = max(1, -(-L2_FLUSH_BYTES // self.weight_bytes))
        self.calls = min(max(20, copies), 64)  # every copy is used within one graph
        self.x = torch.randn(m, k, device="cuda", dtype=DTYPE)
        self.weights = [torch.randn(n, k, device="cuda", dtype=DTYPE) * k**-0.5 for _ in range(copies)]
        self.out = torch.empty(m, n, device="cuda", dtype=DTYPE)

    def weight(self, i: int) -> torch.Tensor:
        return self.weights[i % len(self.weights)]

    def time_us(self, fn: Callable[[int], object]) -> float:
        return time_per_call(fn, calls=self.calls, replays=20) * 1e3

    def measurement(self, us: float) -> dict[str, float]:
        bandwidth = self.weight_bytes / (us * 1e-6)
        return {"us": us, "tb_per_s": bandwidth / 1e12, "share_of_peak": bandwidth / PEAK_BANDWIDTH_BYTES}


def bench(models: list[str], ms: list[int]) -> list[dict[str, Any]]:
    from shoal.kernels.gemv import use_gemv
    from shoal.kernels.triton.gemv import triton_gemv

    results = []
    for model in models:
        for name, (n, k) in SHAPES[model].items():
            for m in ms:
                ops = Operands(m, n, k)
                torch_us = ops.time_us(lambda i, ops=ops: F.linear(ops.x, ops.weight(i)))
                gemv_us = ops.time_us(lambda i, ops=ops: triton_gemv(ops.out, ops.x, ops.weight(i), None))
                triton_gemv(ops.out, ops.x, ops.weight(0), None)
                error = (ops.out.float() - F.linear(ops.x, ops.weight(0)).float()).abs().max().item()
                results.append(
                    {
                        "model": model,
                        "gemm": name,
                        "m": m,
                        "n": n,
                        "k": k,
                        "torch": ops.measurement(torch_us),
                        "gemv": ops.measurement(gemv_us),
                        "speedup": torch_us / gemv_us,
                        "max_abs_diff": error,
                        "use_gemv": use_gemv(m, n, k),
                    }
                )
                del ops
                torch.cuda.empty_cache()
    return results


def sweep(shapes: list[str], ms: list[int], grid: dict[str, tuple[int, ...]], swiglu: bool) -> list[dict[str, Any]]:
    """With `swiglu`: the gemv with its input activated in the kernel (x = [gate, up]) against
    silu_and_mul then F.linear."""
    from shoal.kernels.triton.gemv import GemvTuning, triton_gemv
    from shoal.layers.activation import silu_and_mul

    results = []
    for shape, m in itertools.product(shapes, ms):
        n, k = SWEEP_SHAPES[shape]
        ops = Operands(m, n, k, swiglu)
        if swiglu:
            shape += " (silu_and_mul fused)"
            baseline, x = "silu_and_mul + F.linear", ops.gate_up
            torch_us = ops.time_us(lambda i, ops=ops: F.linear(silu_and_mul(ops.gate_up), ops.weight(i)))
        else:
            baseline, x = "F.linear", ops.x
            torch_us = ops.time_us(lambda i, ops=ops: F.linear(ops.x, ops.weight(i)))
        results.append({"shape": shape, "m": m, "tuning": baseline, **ops.measurement(torch_us)})
        print(f"{shape} m={m} {baseline}: {torch_us:.2f} us")
        for values in itertools.product(*grid.values()):
            tuning = GemvTuning(**dict(zip(grid, values)))
            row: dict[str, Any] = {"shape": shape, "m": m, "tuning": vars(tuning)}
            try:
                us = ops.time_us(
                    lambda i, ops=ops, t=tuning, x=x: triton_gemv(ops.out, x, ops.weight(i), None, t, swiglu=swiglu)
                )
            except Exception as error:  # a setting that does not compile or fit (e.g. OutOfResources)
                row["error"] = str(error).splitlines()[0]
                results.append(row)
                continue
            row.update(ops.measurement(us))
            results.append(row)
            print(f"{shape} m={m} {tuning}: {us:.2f} us, {row['share_of_peak']:.1%} of peak")
        del ops
        torch.cuda.empty_cache()
    return results


def print_bench(results: list[dict[str, Any]]) -> None:
    print(f"\ngemv vs F.linear, {DTYPE}: us per call (TB/s of the weight read, share of 4.26 TB/s)")
    print(f"{'model':>11} {'gemm':>8} {'m':>2} {'F.linear':>26} {'gemv':>26} {'speedup':>8} {'use_gemv':>8}")
    for r in results:
        cells = [f"{t['us']:>8.2f} ({t['tb_per_s']:.2f}, {t['share_of_peak']:>5.1%})" for t in (r["torch"], r["gemv"])]
        print(
            f"{r['model']:>11} {r['gemm']:>8} {r['m']:>2} {cells[0]:>26} {cells[1]:>26} "
            f"{r['speedup']:>7.2f}x {r['use_gemv']!s:>8}"
        )


def print_sweep(results: list[dict[str, Any]]) -> None:
    print("\nbest settings per shape")
    for key in dict.fromkeys((r["shape"], r["m"]) for r in results):
        rows = [r for r in results if (r["shape"], r["m"]) == key and "us" in r]
        baseline = next(r for r in rows if isinstance(r["tuning"], str))
        best = sorted((r for r in rows if r is not baseline), key=lambda r: r["us"])[:5]
        print(f"{key[0]} m={key[1]}: {baseline['tuning']} {baseline['us']:.2f} us ({baseline['share_of_peak']:.1%})")
        for r in best:
            print(f"   {r['us']:.2f} us ({r['share_of_peak']:.1%}) {r['tuning']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("bench_gemv.json"))
    parser.add_argument("--sweep", action="store_true", help="sweep GemvTuning (on --shapes)")
    parser.add_argument("--shapes", nargs="+", choices=list(SWEEP_SHAPES), default=DEFAULT_SWEEP_SHAPES)
    parser.add_argument("--swiglu", action="store_true", help="sweep the down projection with silu_and_mul fused")
    parser.add_argument(
        "--grid", nargs="+", default=[], metavar="FIELD=V1,V2", help="replace the sweep's values of a GemvTuning field"
    )
    parser.add_argument("--models", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--m", type=int, nargs="+", default=None, help=f"rows of x (default {MS}; sweep: 1)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    torch.manual_seed(0)
    import triton

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(DTYPE),
        "peak_bandwidth_tb_per_s": PEAK_BANDWIDTH_BYTES / 1e12,
    }
    if args.sweep:
        grid = dict(SWEEP_GRID)
        for item in args.grid:
            field, values = item.split("=")
            grid[field] = tuple(int(v) for v in values.split(","))
        report["sweep"] = results = sweep(args.shapes, args.m or [1], grid, args.swiglu)
        print_sweep(results)
    else:
        report["gemv"] = results = bench(args.models, args.m or MS)
        print_bench(results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
