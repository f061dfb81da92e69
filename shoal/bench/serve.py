"""`shoal bench serve`: load a running `shoal serve` (or any OpenAI-compatible server) over HTTP.

    shoal bench serve --base-url http://127.0.0.1:8000 --dataset fixed --input-len 512 \\
        --output-len 128 --num-prompts 200 --request-rate 4
    shoal bench serve --dataset sharegpt --sweep max-concurrency --sweep-values 1 4 16 64 \\
        --output-json serve.json --plot serve.png

An asyncio client (httpx, streaming `/v1/completions` with `ignore_eos` and
`stream_options.include_usage`) sends the workload's requests with Poisson arrivals at
`--request-rate` requests/s (inf: all at once), at most `--max-concurrency` in flight. Per request:
TTFT (first text chunk), ITL (gaps between text chunks), TPOT ((latency - TTFT) / (output tokens
- 1)) and end-to-end latency; reported as mean, p50, p90, p99 in ms, with requests/s and tokens/s.
`--sweep` runs the benchmark once per value and plots latency against load (matplotlib).

The served model's folder (the model name when it is a local folder, or `--tokenizer`) gives the
vocabulary for random prompt ids and the tokenizer for ShareGPT prompts, which are sent as text.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.bench import multi_turn
from shoal.bench.report import environment, format_table, print_lines, summarize, write_json
from shoal.bench.workloads import BenchRequest, Workload, add_workload_args, build_workload, random_token_ids

logger = logging.getLogger(__name__)

SWEEP_KINDS = ("request-rate", "max-concurrency")
# Token ids of random prompts when the server's vocabulary is unknown (nano-vllm's range).
DEFAULT_VOCAB_SIZE = 10001


def add_parser(subparsers: Any) -> None:
    from shoal.cli import HelpFormatter

    parser = subparsers.add_parser(
        "serve",
        help="online serving: TTFT, TPOT, ITL and latency against a running server",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    server.add_argument("--model", default=None, help="the model name to send (default: the server's first model)")
    server.add_argument("--tokenizer", default=None, help="the model folder (default: the model name, if a folder)")
    server.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer <key>' (default: none)")
    server.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    server.add_argument(
        "--ready-timeout", type=float, default=0.0, help="seconds to wait for /health first (0: no wait)"
    )
    add_workload_args(parser.add_argument_group("workload"))
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)"
    )
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="the most requests in flight (default: no limit)"
    )
    load.add_argument(
        "--sweep", choices=SWEEP_KINDS, default=None, help="run once per --sweep-values of this knob (default: one run)"
    )
    load.add_argument(
        "--sweep-values",
        type=float,
        nargs="+",
        default=None,
        help="the values --sweep takes, e.g. 1 2 4 inf (default: none)",
    )
    load.add_argument("--num-warmup-requests", type=int, default=1, help="untimed requests first")
    load.add_argument("--arrival-seed", type=int, default=0, help="seed of the Poisson arrivals")
    output = parser.add_argument_group("output")
    output.add_argument("--output-json", default=None, help="write the report here (default: printed only)")
    output.add_argument("--plot", default=None, help="the sweep's PNG (default: --output-json with .png)")
    multi_turn.add_args(parser)
    parser.set_defaults(handler=main)


# ---- one request -------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds from its send)."""

    prompt_len: int
    output_len: int  # requested
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float | None = None
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.latency_s is None or self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)


def completion_body(model: str, request: BenchRequest, temperature: float) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": request.prompt if request.prompt is not None else request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_request(client: Any, base_url: str, body: dict[str, Any], record: RequestRecord) -> RequestRecord:
    """One streamed completion; text chunks mark token arrivals, the usage chunk the counts."""
    start = time.perf_counter()
    arrivals: list[float] = []
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                _read_chunk(json.loads(data), time.perf_counter() - start, arrivals, record)
    except Exception as exc:  # any transport error fails this request only
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.latency_s = time.perf_counter() - start
    if arrivals:
        record.ttft_s = arrivals[0]
        record.itl_s = [b - a for a, b in itertools.pairwise(arrivals)]
    record.num_output_tokens = record.num_output_tokens or len(arrivals)
    record.ok = True
    return record


def _read_chunk(chunk: dict[str, Any], now_s: float, arrivals: list[float], record: RequestRecord) -> None:
    usage = chunk.get("usage")
    if usage:
        record.num_output_tokens = int(usage.get("completion_tokens") or 0)
        record.num_prompt_tokens = int(usage.get("prompt_tokens") or 0)
    for choice in chunk.get("choices") or []:
        if choice.get("text"):
            arrivals.append(now_s)
            return


# ---- one load level ------------------------------------------------------------------------------


async def run_load(
    base_url: str,
    model: str,
    workload: Workload,
    request_rate: float,
    max_concurrency: int | None,
    arrival_seed: int = 0,
    api_key: str | None = None,
    request_timeout_s: float = 600.0,
) -> tuple[list[RequestRecord], float]:
    """Send every request of the workload (Poisson arrivals, capped concurrency); returns the
    records and the wall time from the first send to the last answer."""
    import httpx

    connections = max_concurrency or len(workload.requests)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(arrival_seed)

    async def one(request: BenchRequest) -> RequestRecord:
        record = RequestRecord(request.prompt_len, request.output_len)
        body = completion_body(model, request, workload.temperature)
        if gate is None:
            return await send_request(client, base_url, body, record)
        async with gate:
            return await send_request(client, base_url, body, record)

    async with httpx.AsyncClient(timeout=request_timeout_s, limits=limits, headers=headers) as client:
        tasks = []
        start = time.perf_counter()
        next_send_s = 0.0
        for request in workload.requests:
            delay = next_send_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
            if math.isfinite(request_rate):
                next_send_s += rng.expovariate(request_rate)
        records = list(await asyncio.gather(*tasks))
        return records, time.perf_counter() - start


def summarize_load(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    num_output = sum(r.num_output_tokens for r in done)
    num_input = sum(r.num_prompt_tokens or r.prompt_len for r in done)
    errors = sorted({r.error for r in records if r.error})
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": errors[:5],
        "duration_s": duration_s,
        "num_input_tokens": num_input,
        "num_output_tokens": num_output,
        "requests_per_s": len(done) / duration_s,
        "output_tokens_per_s": num_output / duration_s,
        "total_tokens_per_s": (num_input + num_output) / duration_s,
        "ttft_ms": summarize([r.ttft_s for r in done if r.ttft_s is not None], 1e3),
        "tpot_ms": summarize([t for r in done if (t := r.tpot_s) is not None], 1e3),
        "itl_ms": summarize([gap for r in done for gap in r.itl_s], 1e3),
        "latency_ms": summarize([r.latency_s for r in done if r.latency_s is not None], 1e3),
    }


# ---- the server ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedModel:
    name: str
    folder: str | None  # a local folder with the model's config.json (and maybe a tokenizer)
    max_model_len: int | None


def discover_model(base_url: str, model: str | None, tokenizer: str | None, api_key: str | None) -> ServedModel:
    """The served model's name and, where it is a local folder, its folder and context length."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    cards = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).raise_for_status().json()["data"]
    card = next((c for c in cards if model is None or c["id"] == model), None)
    if card is None:
        raise ValueError(f"the server does not serve {model!r} (it serves {[c['id'] for c in cards]})")
    folder = tokenizer or next(
        (p for p in (card.get("root"), card["id"]) if p and (Path(p) / "config.json").exists()), None
    )
    return ServedModel(card["id"], folder, card.get("max_model_len"))


def vocab_size_of(folder: str | None) -> int:
    if folder is None or not (Path(folder) / "config.json").exists():
        logger.warning(
            "the served model's vocabulary is unknown: random prompt ids are drawn below %d", DEFAULT_VOCAB_SIZE
        )
        return DEFAULT_VOCAB_SIZE
    return int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])


def wait_until_healthy(base_url: str, timeout_s: float, interval_s: float = 0.2) -> float:
    """Poll /health until it answers 200; returns the seconds waited (raises TimeoutError)."""
    import httpx

    start = time.perf_counter()
    while True:
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"{base_url}/health did not answer 200 in {timeout_s} s")
        time.sleep(interval_s)


# ---- the benchmark -------------------------------------------------------------------------------


def load_points(args: argparse.Namespace) -> list[dict[str, Any]]:
    """(request rate, max concurrency) of every run: one, or one per sweep value."""
    if args.sweep is None:
        return [{"request_rate": args.request_rate, "max_concurrency": args.max_concurrency}]
    if not args.sweep_values:
        raise ValueError("--sweep needs --sweep-values")
    if args.sweep == "request-rate":
        return [{"request_rate": v, "max_concurrency": args.max_concurrency} for v in args.sweep_values]
    if any(not math.isfinite(v) or v < 1 or v != int(v) for v in args.sweep_values):
        raise ValueError("max-concurrency sweep values must be whole numbers >= 1")
    return [{"request_rate": args.request_rate, "max_concurrency": int(v)} for v in args.sweep_values]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, then one run per load point. Point i uses workload seed + i and the warm-up its
    own random prompts, so that no run is served from a prefix cache another one filled."""
    if args.ready_timeout > 0:
        wait_until_healthy(args.base_url, args.ready_timeout)
    served = discover_model(args.base_url, args.model, args.tokenizer, args.api_key)
    vocab_size = vocab_size_of(served.folder)

    def workload_for(seed: int) -> Workload:
        point_args = argparse.Namespace(**{**vars(args), "workload_seed": seed})
        return build_workload(point_args, vocab_size, served.max_model_len or 2048, lambda: _tokenizer(served))

    def send(workload: Workload, request_rate: float, max_concurrency: int | None) -> dict[str, Any]:
        load = run_load(
            args.base_url,
            served.name,
            workload,
            request_rate,
            max_concurrency,
            args.arrival_seed,
            args.api_key,
            args.request_timeout,
        )
        return summarize_load(*asyncio.run(load))

    runs, workloads = [], []
    for i, point in enumerate(load_points(args)):
        workloads.append(workload := workload_for(args.workload_seed + i))
        if args.num_warmup_requests > 0:
            send(warmup_workload(workload, args.num_warmup_requests, vocab_size), math.inf, None)
        runs.append({**point, "workload_seed": workload.seed, **send(workload, **point)})
    return {
        "benchmark": "serve",
        "environment": environment(),
        "base_url": args.base_url,
        "model": served.name,
        "workload": workloads[0].describe(),
        "sweep": args.sweep,
        "runs": runs,
    }


def warmup_workload(workload: Workload, num_requests: int, vocab_size: int) -> Workload:
    """Short requests of fresh random ids, shaped like the workload's first ones."""
    rng = random.Random(f"serve-warmup:{workload.seed}")  # ids no workload seed draws
    requests = [
        BenchRequest(random_token_ids(rng, r.prompt_len, vocab_size), min(r.output_len, 8))
        for r in workload.requests[:num_requests]
    ]
    return Workload("warmup", requests, workload.temperature, workload.seed)


def _tokenizer(served: ServedModel) -> Any:
    from shoal.frontend.tokenizer import get_tokenizer

    if served.folder is None:
        raise ValueError("the ShareGPT workload needs the model's tokenizer: pass --tokenizer")
    return get_tokenizer(served.folder)


def print_report(report: dict[str, Any]) -> None:
    w = report["workload"]
    header = [
        "rate",
        "conc.",
        "done",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "ITL p50",
        "ITL p99",
        "lat p50",
        "lat p99",
    ]
    rows = [
        [
            r["request_rate"],
            r["max_concurrency"] or "-",
            f"{r['completed']}/{r['num_requests']}",
            r["requests_per_s"],
            r["output_tokens_per_s"],
            r["ttft_ms"]["p50"],
            r["ttft_ms"]["p99"],
            r["tpot_ms"]["p50"],
            r["itl_ms"]["p50"],
            r["itl_ms"]["p99"],
            r["latency_ms"]["p50"],
            r["latency_ms"]["p99"],
        ]
        for r in report["runs"]
    ]
    lines = [
        f"serve: {report['model']} at {report['base_url']}, {w['name']}, {w['num_requests']:,} requests (times in ms)",
        format_table(header, rows),
    ]
    for r in report["runs"]:
        if r["errors"]:
            lines.append(f"errors: {r['errors']}")
    print_lines(*lines)


def plot_sweep(report: dict[str, Any], path: str | Path) -> None:
    """Latency (TTFT, TPOT, end to end; p50 and p99) against the achieved request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    x = [r["requests_per_s"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (metric, title) in zip(
        axes, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("latency_ms", "end-to-end latency"))
    ):
        for q in ("p50", "p99"):
            ax.plot(x, [r[metric][q] for r in runs], marker="o", label=q)
        knob = "request_rate" if report["sweep"] == "request-rate" else "max_concurrency"
        for xi, r in zip(x, runs):
            ax.annotate(f"{r[knob]:g}", (xi, r[metric]["p50"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_title(f"{title} (ms)")
        ax.set_xlabel("achieved requests/s")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"shoal bench serve: {report['model']}, {report['workload']['name']}, sweep over {report['sweep']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import httpx

    try:
        if args.multi_turn:
            return run_multi_turn(args)
        load_points(args)
        report = run(args)
    except (ValueError, TimeoutError, httpx.HTTPError) as exc:
        parser.exit(2, f"shoal bench serve: error: {exc}\n")
    write_json(args.output_json, report)
    print_report(report)
    if args.sweep is not None:
        plot_path = args.plot or (
            str(Path(args.output_json).with_suffix(".png")) if args.output_json else "bench_serve_sweep.png"
        )
        plot_sweep(report, plot_path)
        print_lines(f"plot: {plot_path}")
    return 0


def run_multi_turn(args: argparse.Namespace) -> int:
    """`--multi-turn` (shoal/bench/multi_turn.py): sessions in place of the workload."""
    if args.ready_timeout > 0:
        wait_until_healthy(args.base_url, args.ready_timeout)
    served = discover_model(args.base_url, args.model, args.tokenizer, args.api_key)
    report = multi_turn.run(args, args.base_url, served.name, vocab_size_of(served.folder))
    write_json(args.output_json, report)
    print_lines(*multi_turn.report_lines(report))
    return 0
