"""The host's work per decode step, engine core and worker together, phase by phase (CPU).

With async scheduling the device runs step N while the host applies step N-1's tokens,
schedules step N+1 and gathers and launches its inputs; when that host work takes longer than
the device's step, the device waits. This benchmark times that host work without a model: the
same steady-state decode batch as `bench_scheduler.py` (`--num-requests` running requests,
~`--prompt-len`-token prompts, one step in flight), through the real `Scheduler` and the real
worker-side code of a `ModelRunner` on the CPU:

- engine core: `schedule` and `update_from_output` (what `bench_scheduler.py` times);
- worker: the persistent batch's update from the step's diffs (`InputBatch.update`), the flat
  inputs and attention metadata (`ModelRunner._prepare_inputs`; a plain batch's sampling
  metadata comes with them), the sampling metadata of the rest (`ModelRunner.sampling_metadata`),
  and turning the sampled tokens into the step's output
  (`SampledStep.result`).

The model config only sizes the worker's buffers (`max_model_len`, `max_num_seqs`); nothing
runs a forward, and on the CPU the buffers' "device copies" are plain memory copies.

    .venv/bin/python benchmarks/bench_host_step.py --output host_step.json
    .venv/bin/python benchmarks/bench_host_step.py --profile   # cProfile of the timed steps
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_scheduler

from shoal.config import EngineArgs
from shoal.engine_core.process import freeze_start_up_heap
from shoal.engine_core.scheduler import Scheduler
from shoal.step import SchedulerOutput
from shoal.workers.model_runner import ModelRunner
from shoal.workers.sampler import SamplerOutput
from shoal.workers.step_output import SampledStep

PHASES = ("schedule", "update_from_output", "input_batch_update", "prepare_inputs", "sampling_metadata", "result")
DEFAULT_MODEL = Path(__file__).parent / "configs" / "qwen3-0.6b"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a model config (no weights are read)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.6, help="the nano-vllm protocol's")
    parser.add_argument("--num-steps", type=int, default=1000, help="timed decode steps")
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the timed steps")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    return parser.parse_args()


def scheduler_args(args: argparse.Namespace) -> argparse.Namespace:
    """bench_scheduler's batch: the same prompts and block size, one step in flight."""
    return argparse.Namespace(
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        shared_prefix_len=128,
        block_size=16,
        num_steps=args.num_steps,
        warmup_steps=args.warmup_steps,
        max_num_batched_tokens=8192,
        no_prefix_caching=False,
        async_scheduling=True,
    )


def make_runner(args: argparse.Namespace, max_model_len: int) -> ModelRunner:
    config = EngineArgs(
        model=args.model,
        load_format="dummy",
        device="cpu",
        max_model_len=max_model_len,
        max_num_seqs=args.num_requests,
    ).create_engine_config()
    return ModelRunner(config, torch.device("cpu"))


class HostStep:
    """One async-scheduling decode step as the host runs it, each phase timed."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, vocab_size: int) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.vocab_size = vocab_size
        self.in_flight: deque[tuple[SchedulerOutput, SampledStep]] = deque()
        self.times_ns: dict[str, list[int]] = {phase: [] for phase in PHASES}

    def run(self, token_id: int, record: bool) -> None:
        clock = time.perf_counter_ns
        t0 = clock()
        sched_out = self.scheduler.schedule()
        t1 = clock()
        slots = self.runner.input_batch.update(sched_out)
        t2 = clock()
        inputs = self.runner._prepare_inputs(sched_out, slots)
        t3 = clock()
        states = [self.runner.input_batch.requests[r] for r in inputs.sampling_req_ids]
        self.runner.sampling_metadata(inputs, states, self.vocab_size)
        t4 = clock()
        sampled = SamplerOutput(sampled_token_ids=torch.full((len(states),), token_id, dtype=torch.int64))
        self.runner.keep_samples(inputs.sampling_slots, sampled.sampled_token_ids)  # the next step's inputs read them
        self.in_flight.append((sched_out, SampledStep(inputs.req_ids, states, sampled, {}, sched_out.step_id)))
        t5 = t6 = t7 = clock()
        if len(self.in_flight) == 2:
            oldest, step = self.in_flight.popleft()
            t5 = clock()
            model_output = step.result()
            t6 = clock()
            self.scheduler.update_from_output(oldest, model_output)
            t7 = clock()
        if record:
            for phase, ns in zip(PHASES, (t1 - t0, t7 - t6, t2 - t1, t3 - t2, t4 - t3, t6 - t5), strict=True):
                self.times_ns[phase].append(ns)


def prefill_all(scheduler: Scheduler, runner: ModelRunner, rng: random.Random) -> None:
    """Admit and prefill every request (synchronously, untimed), telling the worker each step."""
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        sched_out = scheduler.schedule()
        runner.input_batch.update(sched_out)
        model_output = bench_scheduler.fake_model_output(scheduler, sched_out, rng.randrange(1000))
        scheduler.update_from_output(sched_out, model_output)


def summarize(times_ns: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    summary = {}
    for phase, values in times_ns.items():
        us = sorted(v / 1000 for v in values)
        summary[phase] = {"mean_us": statistics.fmean(us), "p50_us": us[len(us) // 2]}
    totals = sorted(sum(v[i] for v in times_ns.values()) / 1000 for i in range(len(times_ns["schedule"])))
    summary["total"] = {"mean_us": statistics.fmean(totals), "p50_us": totals[len(totals) // 2]}
    return summary


def main() -> None:
    args = parse_args()
    rng = random.Random(args.seed)
    sargs = scheduler_args(args)
    scheduler = bench_scheduler.make_scheduler(sargs)
    runner = make_runner(args, scheduler.max_model_len)
    freeze_start_up_heap()
    bench_scheduler.add_requests(scheduler, sargs, rng, temperature=args.temperature)
    prefill_all(scheduler, runner, rng)
    step = HostStep(scheduler, runner, vocab_size=runner.model_config.vocab_size)
    for _ in range(args.warmup_steps):
        step.run(rng.randrange(1000), record=False)
    assert len(scheduler.running) == args.num_requests, "every request must be decoding"

    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    for _ in range(args.num_steps):
        step.run(rng.randrange(1000), record=True)
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)

    summary = summarize(step.times_ns)
    results = {
        "benchmark": "host_step",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "phases": summary,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
    }
    print(f"{args.num_requests} decoding requests, {args.num_steps} steps, one in flight; us per step:")
    for phase, numbers in summary.items():
        print(f"  {phase:<20} mean {numbers['mean_us']:7.1f}   p50 {numbers['p50_us']:7.1f}")
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
