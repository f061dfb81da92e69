"""`shoal bench latency`: one batch of fixed-length requests, timed over several iterations.

    shoal bench latency --model DIR --batch-size 1 --input-len 128 --output-len 512

Each iteration times two generations of fresh random prompts (fresh, so that the prefix cache
never serves one): with `max_tokens=1` (the time to first token) and with `max_tokens=output_len`
(the total). Decode latency per token = (total - TTFT) / (output_len - 1). Reports mean, p50, p90
and p99 over the iterations, the hardware bound of each, and with `--backend both` the ratio to
transformers measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

from shoal.bench import hf_backend
from shoal.bench.common import (
    OfflineSetup,
    add_offline_args,
    describe_bound,
    engine_args_summary,
    hardware_report,
    prepare_offline,
)
from shoal.bench.hardware import WorkloadBound
from shoal.bench.report import environment, format_table, print_lines, summarize, write_json
from shoal.bench.throughput import shoal_generate
from shoal.bench.workloads import BenchRequest, random_token_ids

# Runs `requests` to `max_tokens` new tokens each and returns when all are done.
RunBatch = Callable[[list[BenchRequest], int], object]


def add_parser(subparsers: Any) -> None:
    from shoal.cli import HelpFormatter, add_engine_args

    parser = subparsers.add_parser(
        "latency",
        help="batch latency: time to first token and decode time per token",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    workload = parser.add_argument_group("workload")
    workload.add_argument("--batch-size", type=int, default=8, help="requests generated together")
    workload.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    workload.add_argument("--output-len", type=int, default=128, help="output tokens")
    workload.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    workload.add_argument("--num-iters-warmup", type=int, default=2, help="untimed iterations first")
    workload.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    workload.add_argument("--workload-seed", type=int, default=0, help="seed of the prompts")
    add_offline_args(parser.add_argument_group("benchmark"))
    add_engine_args(parser.add_argument_group("engine (shoal.config.EngineArgs)"))
    parser.set_defaults(handler=main)


class LatencyWorkload:
    """`batch_size` prompts of `input_len` random ids, new ones every time `batch()` is called."""

    def __init__(
        self, batch_size: int, input_len: int, output_len: int, vocab_size: int, temperature: float, seed: int = 0
    ) -> None:
        for name, value in (("batch_size", batch_size), ("input_len", input_len), ("output_len", output_len)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.batch_size, self.input_len, self.output_len = batch_size, input_len, output_len
        self.vocab_size, self.temperature, self.seed = vocab_size, temperature, seed
        self._rng = random.Random(seed)

    def batch(self) -> list[BenchRequest]:
        return [
            BenchRequest(random_token_ids(self._rng, self.input_len, self.vocab_size), self.output_len)
            for _ in range(self.batch_size)
        ]

    def describe(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "temperature": self.temperature,
            "seed": self.seed,
        }


def measure(run_batch: RunBatch, workload: LatencyWorkload, num_iters: int, num_warmup: int) -> dict[str, Any]:
    """Per iteration: TTFT (a max_tokens=1 run), total (a full run) and decode time per token."""
    for _ in range(num_warmup):
        run_batch(workload.batch(), workload.output_len)
    ttft, total = [], []
    for _ in range(num_iters):
        ttft.append(_timed(run_batch, workload.batch(), 1))
        total.append(_timed(run_batch, workload.batch(), workload.output_len))
    steps = max(workload.output_len - 1, 1)
    per_token = [(t - f) / steps for t, f in zip(total, ttft)]
    num_tokens = workload.batch_size * workload.output_len
    return {
        "num_iters": num_iters,
        "ttft_ms": summarize(ttft, 1e3),
        "total_ms": summarize(total, 1e3),
        "decode_ms_per_token": summarize(per_token, 1e3),
        "output_tokens_per_s": num_tokens * len(total) / sum(total),
        "raw_s": {"ttft": ttft, "total": total},
    }


def _timed(run_batch: RunBatch, requests: list[BenchRequest], max_tokens: int) -> float:
    start = time.perf_counter()
    run_batch(requests, max_tokens)
    return time.perf_counter() - start


def _with_max_tokens(requests: list[BenchRequest], max_tokens: int) -> list[BenchRequest]:
    return [BenchRequest(r.prompt_token_ids, max_tokens) for r in requests]


def run_shoal(llm: Any, workload: LatencyWorkload, num_iters: int, num_warmup: int) -> dict[str, Any]:
    def run_batch(requests: list[BenchRequest], max_tokens: int) -> object:
        return shoal_generate(llm, _with_max_tokens(requests, max_tokens), workload.temperature)

    return measure(run_batch, workload, num_iters, num_warmup)


def run_hf(setup: OfflineSetup, workload: LatencyWorkload, num_iters: int, num_warmup: int) -> dict[str, Any]:
    model = hf_backend.load_hf_model(setup.config.model_config, setup.device)
    pad_id = hf_backend.pad_token_id(model, setup.tokenizer())

    def run_batch(requests: list[BenchRequest], max_tokens: int) -> object:
        return hf_backend.generate_batch(model, requests, max_tokens, workload.temperature, pad_id)

    try:
        return measure(run_batch, workload, num_iters, num_warmup)
    finally:
        model = None
        hf_backend.release_memory()


# ---- the report --------------------------------------------------------------------------------


def check_workload(setup: OfflineSetup, workload: LatencyWorkload) -> None:
    max_model_len = setup.config.model_config.max_model_len
    if workload.input_len + workload.output_len > max_model_len:
        raise ValueError(f"input_len + output_len exceeds max_model_len ({max_model_len})")
    max_num_seqs = setup.config.scheduler_config.max_num_seqs
    if workload.batch_size > max_num_seqs:
        raise ValueError(f"batch_size {workload.batch_size} exceeds max_num_seqs ({max_num_seqs})")


def run(
    setup: OfflineSetup, workload: LatencyWorkload, backend: str, num_iters: int, num_warmup: int
) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {}
    if "shoal" in setup.backends(backend):
        llm = setup.create_llm()
        try:
            results["shoal"] = run_shoal(llm, workload, num_iters, num_warmup)
        finally:
            llm.shutdown()
    if "hf" in setup.backends(backend):
        results["hf"] = run_hf(setup, workload, num_iters, num_warmup)
    return make_report(setup, workload, results)


def latency_bound(setup: OfflineSetup, workload: LatencyWorkload) -> dict[str, Any] | None:
    """The bound of the TTFT run (prefill only), of the full run, and per decode token."""
    prompt_lens = [workload.input_len] * workload.batch_size
    first = setup.bound(prompt_lens, [1] * workload.batch_size)
    full = setup.bound(prompt_lens, [workload.output_len] * workload.batch_size)
    if first is None or full is None:
        return None
    per_token_s = (full.bound_s - first.bound_s) / max(workload.output_len - 1, 1)
    return {"ttft_s": first.bound_s, "total_s": full.bound_s, "decode_s_per_token": per_token_s, "full": full.as_dict()}


def make_report(setup: OfflineSetup, workload: LatencyWorkload, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    bound = latency_bound(setup, workload)
    for result in results.values():
        if bound is None:
            result["achieved_share_of_bound"] = None
            continue
        result["achieved_share_of_bound"] = {
            "ttft": 1e3 * bound["ttft_s"] / result["ttft_ms"]["p50"],
            "decode_per_token": 1e3 * bound["decode_s_per_token"] / result["decode_ms_per_token"]["p50"],
            "total": 1e3 * bound["total_s"] / result["total_ms"]["p50"],
        }
    report: dict[str, Any] = {
        "benchmark": "latency",
        "environment": environment(),
        "engine_args": engine_args_summary(setup.engine_args),
        "workload": workload.describe(),
        "results": results,
        "hardware": hardware_report(setup),
        "bound": bound,
    }
    if "shoal" in results and "hf" in results:
        shoal, hf = results["shoal"], results["hf"]
        report["shoal_vs_hf"] = {
            "decode_per_token": hf["decode_ms_per_token"]["p50"] / shoal["decode_ms_per_token"]["p50"],
            "ttft": hf["ttft_ms"]["p50"] / shoal["ttft_ms"]["p50"],
        }
    return report


def print_report(report: dict[str, Any], setup: OfflineSetup) -> None:
    w = report["workload"]
    header = ["backend", "metric", "mean", "p50", "p90", "p99", "p50 of bound"]
    rows = []
    shares = {"ttft_ms": "ttft", "decode_ms_per_token": "decode_per_token", "total_ms": "total"}
    for name, r in report["results"].items():
        for metric, share_key in shares.items():
            s = r[metric]
            share = r["achieved_share_of_bound"]
            rows.append(
                [
                    name,
                    metric,
                    s["mean"],
                    s["p50"],
                    s["p90"],
                    s["p99"],
                    f"{100 * share[share_key]:.1f}%" if share else "-",
                ]
            )
    lines = [
        f"latency: batch {w['batch_size']}, {w['input_len']} in, {w['output_len']} out, "
        f"{report['results'][next(iter(report['results']))]['num_iters']} iterations",
        format_table(header, rows),
    ]
    if "shoal_vs_hf" in report:
        ratio = report["shoal_vs_hf"]
        lines.append(
            f"shoal vs transformers: decode {ratio['decode_per_token']:.2f}x faster per token, TTFT {ratio['ttft']:.2f}x"
        )
    bound = report["bound"]
    if bound is not None:
        lines.append(
            f"bound: TTFT {1e3 * bound['ttft_s']:.3g} ms, decode {1e3 * bound['decode_s_per_token']:.3g} ms/token, "
            f"total {1e3 * bound['total_s']:.3g} ms"
        )
    lines.append(describe_bound(setup, WorkloadBound(**bound["full"]) if bound is not None else None))
    print_lines(*lines)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from shoal.cli import engine_args_from

    try:
        if args.num_iters < 1 or args.num_iters_warmup < 0:
            raise ValueError("--num-iters must be at least 1 and --num-iters-warmup at least 0")
        setup = prepare_offline(engine_args_from(args), args.hardware_bound, args.in_process)
        vocab_size = setup.config.model_config.vocab_size
        workload = LatencyWorkload(
            args.batch_size, args.input_len, args.output_len, vocab_size, args.temperature, args.workload_seed
        )
        check_workload(setup, workload)
    except ValueError as exc:
        parser.exit(2, f"shoal bench latency: error: {exc}\n")
    report = run(setup, workload, args.backend, args.num_iters, args.num_iters_warmup)
    write_json(args.output_json, report)
    print_report(report, setup)
    return 0
