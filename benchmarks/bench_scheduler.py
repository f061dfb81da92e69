"""Engine-core overhead per step: `Scheduler.schedule()` + `update_from_output()`.

No model runs: a fake model output samples one token per request. The batch is in steady-state
decode: `--num-requests` running requests with ~`--prompt-len`-token prompts (the first
`--shared-prefix-len` tokens shared, so prefix caching has work to do), block size 16.

    .venv/bin/python benchmarks/bench_scheduler.py --output bench_scheduler.json
    .venv/bin/python benchmarks/bench_scheduler.py --profile   # cProfile of the timed steps
    .venv/bin/python benchmarks/bench_scheduler.py --async-scheduling

`--async-scheduling` runs the decode steps as the engine does on one GPU: step N+1 is scheduled
(every request one token ahead, on a placeholder) before step N's tokens are applied.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import platform
import pstats
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

from shoal.config import CacheConfig, SchedulerConfig
from shoal.engine_core.process import freeze_start_up_heap
from shoal.engine_core.request import Request
from shoal.engine_core.scheduler import Scheduler
from shoal.sampling_params import SamplingParams
from shoal.step import ModelRunnerOutput, SchedulerOutput

VOCAB_SIZE = 32_000


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--shared-prefix-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-steps", type=int, default=2000, help="timed decode steps")
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--async-scheduling", action="store_true", help="keep one step in flight, as the engine does")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the timed steps")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    return parser.parse_args()


def make_scheduler(args: argparse.Namespace) -> Scheduler:
    max_tokens = args.warmup_steps + args.num_steps + 16  # nobody finishes while we measure
    max_model_len = args.prompt_len * 2 + max_tokens
    num_blocks = args.num_requests * (-(-max_model_len // args.block_size) + 1)
    return Scheduler(
        SchedulerConfig(args.num_requests, args.max_num_batched_tokens, max_model_len, args.async_scheduling),
        CacheConfig(block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching),
        num_blocks,
    )


def add_requests(scheduler: Scheduler, args: argparse.Namespace, rng: random.Random, temperature: float = 0.0) -> None:
    max_tokens = args.warmup_steps + args.num_steps + 16
    prefix = [rng.randrange(VOCAB_SIZE) for _ in range(args.shared_prefix_len)]
    for i in range(args.num_requests):
        prompt_len = rng.randint(args.prompt_len * 7 // 8, args.prompt_len * 9 // 8)
        prompt = prefix + [rng.randrange(VOCAB_SIZE) for _ in range(prompt_len - len(prefix))]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        scheduler.add_request(Request(f"req-{i}", prompt, params, eos_token_id=None, max_tokens=max_tokens))


def fake_model_output(scheduler: Scheduler, sched_out: SchedulerOutput, token_id: int) -> ModelRunnerOutput:
    """A token for every request whose scheduled tokens reach its end (decodes, last chunks)."""
    req_ids = list(sched_out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        sampled.append([token_id] if request.num_computed_tokens == request.num_tokens else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, step_id=sched_out.step_id)


def run_step(scheduler: Scheduler, token_id: int) -> tuple[int, int]:
    """One engine step; returns (ns spent in the scheduler, tokens scheduled)."""
    start = time.perf_counter_ns()
    sched_out = scheduler.schedule()
    elapsed = time.perf_counter_ns() - start
    model_output = fake_model_output(scheduler, sched_out, token_id)  # the model's time, not ours
    start = time.perf_counter_ns()
    scheduler.update_from_output(sched_out, model_output)
    elapsed += time.perf_counter_ns() - start
    return elapsed, sched_out.total_num_scheduled_tokens


def run_async_step(scheduler: Scheduler, token_id: int, in_flight: deque[SchedulerOutput]) -> tuple[int, int]:
    """One engine step with async scheduling: schedule the next step, then apply the oldest one
    in flight (in steady-state decode every request of it sampled one token)."""
    start = time.perf_counter_ns()
    sched_out = scheduler.schedule()
    elapsed = time.perf_counter_ns() - start
    in_flight.append(sched_out)
    if len(in_flight) == 2:
        oldest = in_flight.popleft()
        req_ids = list(oldest.num_scheduled_tokens)
        model_output = ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=[[token_id]] * len(req_ids), step_id=oldest.step_id
        )
        start = time.perf_counter_ns()
        scheduler.update_from_output(oldest, model_output)
        elapsed += time.perf_counter_ns() - start
    return elapsed, sched_out.total_num_scheduled_tokens


def percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, round(q / 100 * (len(sorted_values) - 1)))
    return sorted_values[index]


def main() -> None:
    args = parse_args()
    rng = random.Random(args.seed)
    scheduler = make_scheduler(args)
    # As the engine-core process does once it is built, before any request arrives.
    freeze_start_up_heap()
    add_requests(scheduler, args, rng)

    # Prefill everything, then warm up in decode.
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        run_step(scheduler, rng.randrange(VOCAB_SIZE))
    in_flight: deque[SchedulerOutput] = deque()
    step = functools.partial(run_async_step, in_flight=in_flight) if args.async_scheduling else run_step
    for _ in range(args.warmup_steps):
        step(scheduler, rng.randrange(VOCAB_SIZE))
    assert len(scheduler.running) == args.num_requests, "every request must be decoding"

    tokens = [rng.randrange(VOCAB_SIZE) for _ in range(args.num_steps)]
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    step_us = []
    for token_id in tokens:
        elapsed_ns, num_tokens = step(scheduler, token_id)
        assert num_tokens == args.num_requests
        step_us.append(elapsed_ns / 1000)
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)

    ordered = sorted(step_us)
    kv = scheduler.kv_cache_manager
    results = {
        "benchmark": "scheduler_step",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "num_kv_blocks": kv.block_pool.num_blocks,
        "mean_us": statistics.fmean(step_us),
        "p50_us": percentile(ordered, 50),
        "p99_us": percentile(ordered, 99),
        "max_us": ordered[-1],
        "prefix_cache_hit_rate": kv.prefix_cache_stats.hits / max(kv.prefix_cache_stats.queries, 1),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
    }
    print(
        f"{args.num_requests} decoding requests, {args.num_steps} steps"
        f"{' (async scheduling)' if args.async_scheduling else ''}: "
        f"mean {results['mean_us']:.1f} us, p50 {results['p50_us']:.1f} us, p99 {results['p99_us']:.1f} us "
        f"per step (target < 1000 us); prefix-cache hit rate {results['prefix_cache_hit_rate']:.2f}"
    )
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
