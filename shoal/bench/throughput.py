"""`shoal bench throughput`: an offline workload through `LLM.generate`, timed end to end.

    shoal bench throughput --model DIR --dataset random-nano --max-model-len 4096
    shoal bench throughput --model benchmarks/configs/llama-3.1-8b --load-format dummy \\
        --input-len 1024 --output-len 128 --num-prompts 1000 --backend both

Reports requests/s and input, output and total tokens/s (every request generates exactly its
output length: `ignore_eos`), the workload's hardware bound and the share of it achieved, and
with `--backend both` the ratio to transformers measured in the same run.

`--structured-output json-schema` puts a JSON schema on every request (`shoal/bench/structured.py`;
the model's tokenizer is needed: `--tokenizer` beside a config-only folder); `both` runs the
workload unconstrained and then constrained on the same engine and reports the slowdown.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
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
from shoal.bench.report import environment, format_table, print_lines, write_json
from shoal.bench.structured import STRUCTURED_OUTPUT_MODES, bench_structured_outputs
from shoal.bench.workloads import BenchRequest, Workload, add_workload_args, build_workload, random_token_ids

# Warm-up: this many requests shaped like the workload's first ones (fresh ids: no cache hits).
NUM_WARMUP_REQUESTS = 8
WARMUP_OUTPUT_LEN = 16


def add_parser(subparsers: Any) -> None:
    from shoal.cli import HelpFormatter, add_engine_args

    parser = subparsers.add_parser(
        "throughput",
        help="offline throughput: requests/s and tokens/s of a whole workload",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_workload_args(parser.add_argument_group("workload"))
    benchmark = parser.add_argument_group("benchmark")
    add_offline_args(benchmark)
    benchmark.add_argument(
        "--structured-output",
        choices=STRUCTURED_OUTPUT_MODES,
        default="none",
        help="json-schema: a JSON schema on every request; both: the workload without, then with it",
    )
    benchmark.add_argument(
        "--num-loras",
        type=int,
        default=0,
        help="spread the requests evenly over this many LoRA adapters (turns on --enable-lora; 0: the base model)",
    )
    benchmark.add_argument("--lora-rank", type=int, default=16, help="the rank of the adapters written for --num-loras")
    benchmark.add_argument(
        "--lora-dir",
        default=None,
        help="the adapters, DIR/adapter_{i} (benchmarks/make_lora_adapters.py); missing ones are written there "
        "(default: a temporary folder)",
    )
    add_engine_args(parser.add_argument_group("engine (shoal.config.EngineArgs)"))
    parser.set_defaults(handler=main)


# ---- the backends ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThroughputResult:
    backend: str
    elapsed_s: float
    num_requests: int
    num_input_tokens: int
    num_output_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "elapsed_s": self.elapsed_s,
            "num_requests": self.num_requests,
            "num_input_tokens": self.num_input_tokens,
            "num_output_tokens": self.num_output_tokens,
            "requests_per_s": self.num_requests / self.elapsed_s,
            "input_tokens_per_s": self.num_input_tokens / self.elapsed_s,
            "output_tokens_per_s": self.num_output_tokens / self.elapsed_s,
            "total_tokens_per_s": (self.num_input_tokens + self.num_output_tokens) / self.elapsed_s,
        }


def warmup_requests(workload: Workload, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(f"warmup:{workload.seed}")  # ids no workload seed draws
    return [
        BenchRequest(random_token_ids(rng, r.prompt_len, vocab_size), min(r.output_len, WARMUP_OUTPUT_LEN))
        for r in workload.requests[:NUM_WARMUP_REQUESTS]
    ]


def shoal_generate(
    llm: Any, requests: list[BenchRequest], temperature: float, structured: bool = False, loras: list[Any] | None = None
) -> list[Any]:
    from shoal.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    # A schema's document never ends within the output length, which ends every request as
    # ignore_eos would (ignore_eos itself cannot be combined with a grammar).
    constraint = {"structured_outputs": bench_structured_outputs()} if structured else {"ignore_eos": True}
    params = [
        SamplingParams(max_tokens=r.output_len, temperature=temperature, detokenize=False, **constraint)
        for r in requests
    ]
    # LoRA: request i runs with adapter i mod N (every adapter loaded before the timed run).
    lora_request = [loras[i % len(loras)] for i in range(len(requests))] if loras else None
    return llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)


def run_shoal(
    llm: Any, workload: Workload, vocab_size: int, structured: bool = False, loras: list[Any] | None = None
) -> dict[str, Any]:
    """One warm-up run of a few requests, then the whole workload, timed."""
    for lora in loras or ():
        llm.add_lora(lora)
    shoal_generate(llm, warmup_requests(workload, vocab_size), workload.temperature, structured, loras)
    before = llm.get_stats()
    start = time.perf_counter()
    outputs = shoal_generate(llm, workload.requests, workload.temperature, structured, loras)
    elapsed = time.perf_counter() - start
    num_input = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    name = "shoal+json-schema" if structured else "shoal"
    result = ThroughputResult(name, elapsed, len(outputs), num_input, num_output).as_dict()
    return {**result, **engine_step_times(before, llm.get_stats())}


def engine_step_times(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Steps of the timed run and the engine core's own time per step (outside execute_model:
    scheduling and applying the outputs), from the core's cumulative counters."""
    num_steps = after["num_steps"] - before["num_steps"]
    if num_steps <= 0:
        return {}
    outside = (after["step_s"] - after["execute_model_s"]) - (before["step_s"] - before["execute_model_s"])
    return {
        "num_steps": num_steps,
        "step_ms_mean": (after["step_s"] - before["step_s"]) / num_steps * 1e3,
        "engine_overhead_us_per_step": outside / num_steps * 1e6,
    }


def run_hf(setup: OfflineSetup, workload: Workload, batch_size: int) -> dict[str, Any]:
    """The workload through transformers in this process (after shoal's engine has shut down)."""
    model = hf_backend.load_hf_model(setup.config.model_config, setup.device)
    try:
        pad_id = hf_backend.pad_token_id(model, setup.tokenizer())
        hf_backend.warm_up(model, workload.requests, workload.temperature, pad_id)
        run = hf_backend.run_workload(model, workload.requests, batch_size, workload.temperature, pad_id)
    finally:
        del model
        hf_backend.release_memory()
    result = ThroughputResult(
        "hf", run.elapsed_s, len(workload.requests), workload.num_input_tokens, workload.num_output_tokens
    )
    return {
        **result.as_dict(),
        "hf_batch_size": batch_size,
        "hf_batches": run.num_batches,
        "hf_generated_tokens": run.num_generated_tokens,
    }


# ---- the report --------------------------------------------------------------------------------


def run(
    setup: OfflineSetup,
    workload: Workload,
    backend: str,
    hf_batch_size: int = 64,
    structured_output: str = "none",
    loras: list[Any] | None = None,
) -> dict[str, Any]:
    """Run the workload through each backend (shoal first; unconstrained, then with a JSON
    schema per request, as `structured_output` asks) and build the report."""
    setup.check_fits(workload.requests)
    results: dict[str, dict[str, Any]] = {}
    if "shoal" in setup.backends(backend):
        start = time.perf_counter()
        llm = setup.create_llm()
        engine_start_s = time.perf_counter() - start
        vocab_size = setup.config.model_config.vocab_size
        try:
            for structured in {"none": [False], "json-schema": [True], "both": [False, True]}[structured_output]:
                result = run_shoal(llm, workload, vocab_size, structured, loras)
                results[result["backend"]] = {**result, "engine_start_s": engine_start_s}
        finally:
            llm.shutdown()
    if "hf" in setup.backends(backend):
        results["hf"] = run_hf(setup, workload, hf_batch_size)
    return make_report(setup, workload, results)


def make_report(setup: OfflineSetup, workload: Workload, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    bound = setup.bound([r.prompt_len for r in workload.requests], [r.output_len for r in workload.requests])
    for result in results.values():
        result["achieved_share_of_bound"] = bound.bound_s / result["elapsed_s"] if bound is not None else None
        result["achieved_share_of_serial_bound"] = (
            bound.serial_bound_s / result["elapsed_s"] if bound is not None else None
        )
    report: dict[str, Any] = {
        "benchmark": "throughput",
        "environment": environment(),
        "engine_args": engine_args_summary(setup.engine_args),
        "workload": workload.describe(),
        "results": results,
        "hardware": hardware_report(setup),
        "bound": bound.as_dict() if bound is not None else None,
    }
    if "shoal" in results and "hf" in results:
        report["shoal_vs_hf"] = results["shoal"]["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"]
    if "shoal" in results and "shoal+json-schema" in results:
        # How much longer the constrained run took than the unconstrained one (0.1: 10% slower).
        report["json_schema_slowdown"] = results["shoal+json-schema"]["elapsed_s"] / results["shoal"]["elapsed_s"] - 1
    return report


def print_report(report: dict[str, Any], setup: OfflineSetup) -> None:
    workload, results = report["workload"], report["results"]
    rows = [
        [
            name,
            r["elapsed_s"],
            r["requests_per_s"],
            r["input_tokens_per_s"],
            r["output_tokens_per_s"],
            r["total_tokens_per_s"],
            f"{100 * r['achieved_share_of_bound']:.1f}%" if r["achieved_share_of_bound"] is not None else "-",
        ]
        for name, r in results.items()
    ]
    header = ["backend", "time (s)", "requests/s", "input tok/s", "output tok/s", "total tok/s", "of bound"]
    lines = [
        f"throughput: {workload['name']}, {workload['num_requests']:,} requests, "
        f"{workload['num_input_tokens']:,} input + {workload['num_output_tokens']:,} output tokens",
        format_table(header, rows),
    ]
    if "shoal_vs_hf" in report:
        lines.append(f"shoal / transformers output tokens/s: {report['shoal_vs_hf']:.2f}x")
    if "json_schema_slowdown" in report:
        lines.append(f"a JSON schema on every request: {100 * report['json_schema_slowdown']:+.1f}% time")
    shoal = results.get("shoal", {})
    if "engine_overhead_us_per_step" in shoal:
        lines.append(
            f"engine steps: {shoal['num_steps']:,}, {shoal['step_ms_mean']:.2f} ms each, of which "
            f"{shoal['engine_overhead_us_per_step']:.0f} us outside execute_model (scheduling, outputs)"
        )
    bound = WorkloadBound(**report["bound"]) if report["bound"] is not None else None
    lines.append(describe_bound(setup, bound))
    print_lines(*lines)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from shoal.cli import engine_args_from

    try:
        if args.num_loras:
            args.enable_lora = True
            args.max_lora_rank = max(args.max_lora_rank, args.lora_rank)
        setup = prepare_offline(engine_args_from(args), args.hardware_bound, args.in_process)
        loras = bench_loras(setup, args.num_loras, args.lora_rank, args.lora_dir)
        model_config = setup.config.model_config
        workload = build_workload(args, model_config.vocab_size, model_config.max_model_len, setup.tokenizer)
        setup.check_fits(workload.requests)
    except ValueError as exc:
        parser.exit(2, f"shoal bench throughput: error: {exc}\n")
    report = run(setup, workload, args.backend, args.hf_batch_size, args.structured_output, loras)
    if loras:
        report["num_loras"], report["lora_rank"] = len(loras), args.lora_rank
    write_json(args.output_json, report)
    print_report(report, setup)
    return 0


def bench_loras(setup: OfflineSetup, num_loras: int, rank: int, lora_dir: str | None) -> list[Any]:
    """The `LoRARequest` of each adapter of a `--num-loras` run, written first where missing."""
    if num_loras <= 0:
        return []
    import tempfile

    from shoal.lora.random_adapters import write_random_adapters
    from shoal.lora.request import LoRARequest

    model_config = setup.config.model_config
    root = lora_dir or tempfile.mkdtemp(prefix="shoal-bench-loras-")
    folders = write_random_adapters(
        model_config.hf_config, root, num_loras, rank, model_config.dtype, model_config.model
    )
    return [LoRARequest(f"adapter_{i}", i + 1, str(folder)) for i, folder in enumerate(folders)]
