"""The H200 benchmark suite that tests/gpu/run_bench.sh runs: `shoal bench`'s own functions, with
one engine per model shape so that dummy 8B weights are made once for several workloads.

1. Llama-3.1-8B shape, dummy bf16 weights, one engine (max_model_len 4096):
   the nano-vllm protocol; 1000 × (1024 in, 128 out); batch-1 latency 128 in / 512 out
   (3 iterations after 1 warm-up); 64 × (512 in, 128 out), whose transformers run (after the
   engine is shut down, in this process) gives the shoal / transformers ratio.
2. Qwen3-0.6B shape, dummy bf16 weights: the nano-vllm protocol.
3. `shoal serve` of the Llama-3.1-8B shape with dummy weights: seconds from the command to the
   first 200 from /health and to the first completion, then 256 × (512 in, 128 out) at once
   (no tokenizer, so no text chunks: latency and throughput only, no TTFT/ITL).
4. `llama8b_wide`: the Llama-3.1-8B shape's nano and 1000 × (1024, 128) runs again with the
   batching limits vLLM's offline `LLM` takes on an H100/H200 (max_num_seqs 1024,
   max_num_batched_tokens 16384, where shoal's defaults are 256 and 8192), so that the
   comparison with vLLM's numbers is also made at its own settings (not in the default steps
   since run E showed both runs slower there than at shoal's defaults).
5. `host_step`: `benchmarks/bench_host_step.py` on this machine's CPU: the host's work per
   decode step (scheduler and worker side, no model) for 256 requests, phase by phase.
6. `sharegpt` (not in the default steps either: it needs `tests/gpu/stage_sharegpt.py`'s folder,
   --sharegpt-dir): ShareGPT prompts on the Llama-3.1-8B shape with a Llama-3 tokenizer, 64 at a
   time, offline (max_num_seqs 64) and then over HTTP (a client keeping 64 streams open): the
   served output tokens/s as a share of the offline run's, and TTFT / ITL p50 and p99.

Each result is written to --out as soon as it finishes (the same JSON as `shoal bench`), and a
summary table is printed at the end, also after a failure or an interrupt (timeout -s INT).
`--smoke MODEL_DIR` runs the same steps on CPU with a tiny model and tiny workloads.

    python3 tests/gpu/bench_suite.py --out $OUT [--only llama8b qwen06b serve llama8b_wide]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shoal.bench import latency, throughput  # noqa: E402
from shoal.bench.common import prepare_offline  # noqa: E402
from shoal.bench.report import format_table, print_lines, write_json  # noqa: E402
from shoal.bench.serve import run_load, summarize_load, wait_until_healthy  # noqa: E402
from shoal.bench.workloads import (  # noqa: E402
    Workload,
    fixed_lengths,
    random_nano,
    random_token_ids,
    sharegpt_requests,
)
from shoal.config import EngineArgs  # noqa: E402

CONFIGS = ROOT / "benchmarks" / "configs"
SERVE_PORT = 8123


@dataclass(frozen=True)
class Plan:
    """Models and workload sizes: (requests, input len, output len) triples."""

    big_model: Path
    small_model: Path
    dtype: str
    max_model_len: int
    nano: tuple[int, int, int]  # requests, min len, max len
    fixed: tuple[int, int, int]
    latency: tuple[int, int, int]
    latency_iters: tuple[int, int]  # timed, warm-up
    ratio: tuple[int, int, int]
    serve_load: tuple[int, int, int]
    sharegpt: tuple[int, int] = (500, 64)  # requests, concurrency
    host_step: tuple[int, int] = (256, 1000)  # decoding requests, timed steps
    wide_batching: tuple[int, int] = (1024, 16384)  # vLLM's offline max_num_seqs, max_num_batched_tokens
    big_label: str = "llama8b"
    small_label: str = "qwen3_0.6b"
    device: str = "auto"


H200 = Plan(
    big_model=CONFIGS / "llama-3.1-8b",
    small_model=CONFIGS / "qwen3-0.6b",
    dtype="bfloat16",
    max_model_len=4096,  # nano-vllm's setting; every workload here fits
    nano=(256, 100, 1024),
    fixed=(1000, 1024, 128),
    latency=(1, 128, 512),
    latency_iters=(3, 1),
    ratio=(64, 512, 128),
    serve_load=(256, 512, 128),
)


def smoke_plan(model: Path) -> Plan:
    sizes = dict(
        nano=(8, 10, 40),
        fixed=(16, 32, 8),
        latency=(1, 16, 16),
        ratio=(8, 32, 8),
        serve_load=(8, 32, 8),
        sharegpt=(12, 4),
        wide_batching=(32, 512),
        host_step=(16, 30),
    )
    return Plan(
        model,
        model,
        "float32",
        256,
        latency_iters=(2, 1),
        big_label="smoke",
        small_label="smoke_small",
        device="cpu",
        **sizes,
    )


class Suite:
    def __init__(self, out: Path, plan: Plan, sharegpt_dir: Path | None = None) -> None:
        self.out, self.plan, self.sharegpt_dir = out, plan, sharegpt_dir
        self.rows: list[list[Any]] = []
        self.start = time.perf_counter()

    def save(self, name: str, report: dict[str, Any]) -> None:
        write_json(self.out / f"{name}.json", report)
        print_lines(f"[{time.perf_counter() - self.start:6.1f} s] wrote {name}.json")

    def row(self, name: str, metric: str, value: float, share: float | None = None, note: str = "") -> None:
        self.rows.append([name, metric, value, f"{100 * share:.1f}%" if share is not None else "-", note])

    def summary(self) -> None:
        header = ["run", "metric", "value", "of bound", "note"]
        elapsed = time.perf_counter() - self.start
        print_lines("", f"summary ({elapsed:.0f} s)", format_table(header, self.rows))

    def engine_args(self, model: Path) -> EngineArgs:
        p = self.plan
        return EngineArgs(
            model=str(model), load_format="dummy", dtype=p.dtype, max_model_len=p.max_model_len, device=p.device
        )

    def nano(self, vocab_size: int) -> Workload:
        num_requests, min_len, max_len = self.plan.nano
        return random_nano(vocab_size, num_requests, min_len=min_len, max_len=max_len)


def throughput_step(
    suite: Suite, setup: Any, llm: Any, workload: Workload, name: str, extra: dict[str, Any] | None = None
) -> None:
    vocab_size = setup.config.model_config.vocab_size
    result = {**throughput.run_shoal(llm, workload, vocab_size), **(extra or {})}
    report = throughput.make_report(setup, workload, {"shoal": result})
    suite.save(name, report)
    throughput.print_report(report, setup)
    share = result["achieved_share_of_bound"]
    suite.row(name, "output tok/s", result["output_tokens_per_s"], share, f"{result['elapsed_s']:.1f} s")
    suite.row(name, "total tok/s", result["total_tokens_per_s"], share, f"{result['requests_per_s']:.2f} req/s")


def latency_step(suite: Suite, setup: Any, llm: Any) -> None:
    batch_size, input_len, output_len = suite.plan.latency
    vocab_size = setup.config.model_config.vocab_size
    workload = latency.LatencyWorkload(batch_size, input_len, output_len, vocab_size, temperature=1.0, seed=2)
    num_iters, num_warmup = suite.plan.latency_iters
    result = latency.run_shoal(llm, workload, num_iters, num_warmup)
    report = latency.make_report(setup, workload, {"shoal": result})
    name = f"{suite.plan.big_label}_latency_b{batch_size}_{input_len}x{output_len}"
    suite.save(name, report)
    latency.print_report(report, setup)
    shares = result["achieved_share_of_bound"] or {}
    suite.row(name, "TTFT ms p50", result["ttft_ms"]["p50"], shares.get("ttft"))
    suite.row(name, "decode ms/token p50", result["decode_ms_per_token"]["p50"], shares.get("decode_per_token"))


def big_model(suite: Suite) -> None:
    """The Llama-3.1-8B shape: one engine for three workloads, then transformers for the ratio."""
    setup = prepare_offline(suite.engine_args(suite.plan.big_model), measure_bound=True, in_process=False)
    c = setup.ceilings
    suite.row("device", "copy GB/s", c.copy_bytes_per_s / 1e9, note=c.device_name)
    suite.row("device", f"{c.gemm_dtype} GEMM TFLOP/s", c.gemm_flops_per_s / 1e12, note=f"N={c.gemm_size}")
    vocab_size = setup.config.model_config.vocab_size
    start = time.perf_counter()
    llm = setup.create_llm()
    engine_start_s = time.perf_counter() - start
    label = suite.plan.big_label
    suite.row(label, "engine start s", engine_start_s, note=f"{suite.plan.big_model.name}, dummy {suite.plan.dtype}")
    # Distinct seeds: no workload's prompt is a prefix of another's (one engine, prefix caching on).
    ratio_workload = fixed_lengths(*suite.plan.ratio, vocab_size, seed=1)
    try:
        throughput_step(suite, setup, llm, suite.nano(vocab_size), f"{label}_nano", {"engine_start_s": engine_start_s})
        n, i, o = suite.plan.fixed
        throughput_step(suite, setup, llm, fixed_lengths(n, i, o, vocab_size), f"{label}_{n}x{i}x{o}")
        latency_step(suite, setup, llm)
        shoal_ratio = throughput.run_shoal(llm, ratio_workload, vocab_size)
    finally:
        llm.shutdown()
    hf = throughput.run_hf(setup, ratio_workload, batch_size=suite.plan.ratio[0])
    report = throughput.make_report(setup, ratio_workload, {"shoal": shoal_ratio, "hf": hf})
    n, i, o = suite.plan.ratio
    suite.save(f"{label}_vs_hf_{n}x{i}x{o}", report)
    throughput.print_report(report, setup)
    suite.row(
        f"{label} vs hf",
        "shoal output tok/s",
        shoal_ratio["output_tokens_per_s"],
        shoal_ratio["achieved_share_of_bound"],
    )
    suite.row(f"{label} vs hf", "hf output tok/s", hf["output_tokens_per_s"], hf["achieved_share_of_bound"])
    suite.row(f"{label} vs hf", "shoal / hf", report["shoal_vs_hf"], note=f"{n} x ({i} in, {o} out), hf batch {n}")


def big_model_wide(suite: Suite) -> None:
    """The big model's throughput runs at vLLM's offline batching limits for large GPUs."""
    max_num_seqs, max_num_batched_tokens = suite.plan.wide_batching
    engine_args = dataclasses.replace(
        suite.engine_args(suite.plan.big_model),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    setup = prepare_offline(engine_args, measure_bound=True, in_process=False)
    llm = setup.create_llm()
    label = f"{suite.plan.big_label}_wide"
    try:
        vocab_size = setup.config.model_config.vocab_size
        throughput_step(suite, setup, llm, suite.nano(vocab_size), f"{label}_nano")
        n, i, o = suite.plan.fixed
        throughput_step(suite, setup, llm, fixed_lengths(n, i, o, vocab_size, seed=3), f"{label}_{n}x{i}x{o}")
    finally:
        llm.shutdown()


def small_model(suite: Suite) -> None:
    setup = prepare_offline(suite.engine_args(suite.plan.small_model), measure_bound=True, in_process=False)
    llm = setup.create_llm()
    try:
        nano = suite.nano(setup.config.model_config.vocab_size)
        throughput_step(suite, setup, llm, nano, f"{suite.plan.small_label}_nano")
    finally:
        llm.shutdown()


@contextlib.contextmanager
def serving(suite: Suite, *flags: str) -> Iterator[tuple[str, list[str], float]]:
    """`shoal serve` of the big model's dummy weights (plus `flags`) until the block ends; yields
    its URL, its command and the seconds from the command to the first 200 from /health."""
    plan, url = suite.plan, f"http://127.0.0.1:{SERVE_PORT}"
    command = [sys.executable, "-m", "shoal.cli", "serve", str(plan.big_model), "--load-format", "dummy"]
    command += ["--dtype", plan.dtype, "--max-model-len", str(plan.max_model_len), "--device", plan.device]
    command += ["--port", str(SERVE_PORT), "--disable-access-log", "--stats-interval", "0", *flags]
    log_path = Path("/tmp/shoal-bench-serve.log")
    with open(log_path, "wb") as log:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            wait_until_healthy(url, timeout_s=300)
            yield url, command, time.perf_counter() - start
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            print_lines("---- shoal serve log (tail) ----", *tail)


def serve(suite: Suite) -> None:
    """Ready-to-answer time of `shoal serve` with the big model's dummy weights, then a short load."""
    import httpx

    plan = suite.plan
    vocab_size = json.loads((plan.big_model / "config.json").read_text())["vocab_size"]
    start = time.perf_counter()
    with serving(suite) as (url, command, health_s):
        body = {
            "prompt": random_token_ids(random.Random("probe"), 128, vocab_size),
            "max_tokens": 16,
            "ignore_eos": True,
        }
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        first_s = time.perf_counter() - start
        suite.row(f"{plan.big_label} serve", "s to /health 200", health_s, note="from the command")
        suite.row(f"{plan.big_label} serve", "s to 1st completion", first_s, note="128 in, 16 out")
        n, i, o = plan.serve_load
        records, duration = asyncio.run(
            run_load(url, str(plan.big_model), fixed_lengths(n, i, o, vocab_size), math.inf, None)
        )
        load = summarize_load(records, duration)
        note = f"{n} x ({i} in, {o} out) at once, {load['completed']} done"
        suite.row(f"{plan.big_label} serve", "output tok/s", load["output_tokens_per_s"], note=note)
        suite.row(f"{plan.big_label} serve", "latency ms p50", load["latency_ms"]["p50"])
        report = {"command": command, "time_to_health_s": health_s, "time_to_first_completion_s": first_s}
        suite.save(f"{plan.big_label}_serve", {**report, "load": load})


def sharegpt(suite: Suite) -> None:
    """ShareGPT prompts, `concurrency` at a time: offline, then over HTTP with streaming."""
    from transformers import AutoTokenizer

    if suite.sharegpt_dir is None:
        raise ValueError("the sharegpt step needs --sharegpt-dir (made by tests/gpu/stage_sharegpt.py)")
    plan, tokenizer_dir = suite.plan, suite.sharegpt_dir / "tokenizer"
    num_requests, concurrency = plan.sharegpt
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    workload = sharegpt_requests(
        tokenizer, num_requests, plan.max_model_len, path=suite.sharegpt_dir / "sharegpt.json", temperature=0.0
    )
    engine_args = dataclasses.replace(
        suite.engine_args(plan.big_model), tokenizer=str(tokenizer_dir), max_num_seqs=concurrency
    )
    setup = prepare_offline(engine_args, measure_bound=False, in_process=False)
    llm = setup.create_llm()
    try:
        offline = throughput.run_shoal(llm, workload, setup.config.model_config.vocab_size)
    finally:
        llm.shutdown()
    flags = ("--tokenizer", str(tokenizer_dir), "--max-num-seqs", str(concurrency))
    with serving(suite, *flags) as (url, command, _):
        records, duration = asyncio.run(run_load(url, str(plan.big_model), workload, math.inf, concurrency))
    load = summarize_load(records, duration)
    label, share = f"{plan.big_label} sharegpt", load["output_tokens_per_s"] / offline["output_tokens_per_s"]
    note = f"{num_requests} prompts, {concurrency} at a time, {load['completed']} done"
    suite.row(label, "offline output tok/s", offline["output_tokens_per_s"], note=f"max_num_seqs {concurrency}")
    suite.row(label, "served output tok/s", load["output_tokens_per_s"], note=note)
    suite.row(label, "served / offline", share, note="target >= 0.9")
    for metric in ("ttft_ms", "itl_ms"):
        suite.row(label, f"{metric} p50 / p99", load[metric]["p50"], note=f"p99 {load[metric]['p99']:.1f}")
    report = {"command": command, "workload": workload.describe(), "offline": offline, "served": load}
    suite.save(f"{plan.big_label}_sharegpt_c{concurrency}", {**report, "served_over_offline": share})


def host_step(suite: Suite) -> None:
    """The host's work per decode step on this machine's CPU (no model, no device)."""
    num_requests, num_steps = suite.plan.host_step
    path = suite.out / "host_step.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_host_step.py"), "--output", str(path)]
    command += ["--num-requests", str(num_requests), "--num-steps", str(num_steps), "--warmup-steps", "10"]
    subprocess.run(command, check=True)
    phases = json.loads(path.read_text())["phases"]
    engine_us = phases["schedule"]["p50_us"] + phases["update_from_output"]["p50_us"]
    suite.row("host_step", "engine core us/step p50", round(engine_us, 1), note=f"{num_requests} decoding requests")
    suite.row("host_step", "all host work us/step p50", round(phases["total"]["p50_us"], 1))


STEPS = {
    "llama8b": big_model,
    "qwen06b": small_model,
    "serve": serve,
    "llama8b_wide": big_model_wide,
    "sharegpt": sharegpt,
    "host_step": host_step,
}
DEFAULT_STEPS = ["host_step", "llama8b", "qwen06b", "serve"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="+", choices=list(STEPS), default=DEFAULT_STEPS)
    parser.add_argument("--sharegpt-dir", type=Path, default=None, help="tests/gpu/stage_sharegpt.py's folder")
    parser.add_argument("--smoke", type=Path, default=None, help="a tiny model folder: the same steps on CPU, small")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    suite = Suite(args.out, smoke_plan(args.smoke) if args.smoke else H200, args.sharegpt_dir)
    failures = 0
    try:
        for name in args.only:
            print_lines(f"==== {name} ({time.perf_counter() - suite.start:.0f} s) ====")
            try:
                STEPS[name](suite)
            except Exception:
                failures += 1
                traceback.print_exc()
                suite.row(name, "FAILED", math.nan, note="see the log")
    except KeyboardInterrupt:
        failures += 1
        suite.row("suite", "INTERRUPTED", math.nan, note="out of time")
    finally:
        suite.summary()
        print_lines(json.dumps({"failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
