"""Where a step's time goes on the GPU machine: device busy share and host hot spots.

Runs one offline workload twice on one engine (dummy weights of a real shape) after a warm-up:
under torch.profiler (the device's kernel time against the wall time: the share the device was
busy, and the top kernels) and under cProfile (the host's Python functions by own time). With
`--multiprocess` the engine core runs in its own process, as `shoal bench` runs it, and is
profiled there through `LLM.start_profile` (a Chrome trace per worker beside --out; no cProfile).
With `--timing-only`, no profiler: an A/B of kernel tunings (`--decode-tuning`), one engine each.

    python3 tests/gpu/profile_steps.py --model benchmarks/configs/qwen3-0.6b --num-prompts 256 \
        --input-len 512 --output-len 64 --out $OUT/profile_qwen06b.txt
    python3 tests/gpu/profile_steps.py --model benchmarks/configs/llama-3.1-8b --nano --out nano.txt
    python3 tests/gpu/profile_steps.py --model benchmarks/configs/qwen3-0.6b --nano --multiprocess --out q.txt
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shoal import LLM, SamplingParams
from shoal.bench.throughput import engine_step_times
from shoal.bench.workloads import fixed_lengths, random_nano
from shoal.workers.profiler import device_busy_s, device_idle_report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--nano", action="store_true", help="the nano-vllm protocol instead of fixed lengths")
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine-arg", nargs="*", default=[], help="KEY=VALUE engine arguments (ints or bools)")
    parser.add_argument(
        "--decode-tuning", nargs="*", default=[], help="KEY=VALUE fields of the decode attention's DecodeTuning"
    )
    parser.add_argument(
        "--timing-only", action="store_true", help="no profilers: the wall of two runs after the warm-up"
    )
    parser.add_argument(
        "--multiprocess",
        action="store_true",
        help="the engine core in its own process, as `shoal bench` runs it, profiled there (LLM.start_profile; "
        "no cProfile, no --decode-tuning)",
    )
    args = parser.parse_args()
    if args.multiprocess and args.decode_tuning:
        parser.error("--decode-tuning patches this process's kernels: not with --multiprocess")
    extra = _key_values(args.engine_arg)
    if args.decode_tuning:  # the engine runs in this process (multiprocess=False), so this reaches it
        from shoal.kernels.triton import paged_attention as tpa

        tpa.DECODE_TUNING = dataclasses.replace(tpa.DECODE_TUNING, **_key_values(args.decode_tuning))
    engine_args = {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 4096, **extra}
    llm = LLM(args.model, multiprocess=args.multiprocess, **engine_args)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    if args.nano:
        workload = random_nano(vocab)
    else:
        workload = fixed_lengths(args.num_prompts, args.input_len, args.output_len, vocab, temperature=0.6)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    params = [
        # As `shoal bench throughput` asks: token ids only, no detokenizing (which here would run
        # in the engine's process and count as its host time).
        SamplingParams(temperature=workload.temperature, max_tokens=r.output_len, ignore_eos=True, detokenize=False)
        for r in workload.requests
    ]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    header = f"workload {workload.describe()}, engine args {extra}, decode tuning {args.decode_tuning}"
    if args.timing_only:
        # The first full run meets what the warm-up did not (compiles, kernels loaded on first
        # use); the gap to the second run's wall is what those cost.
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        lines = [f"first full run {time.perf_counter() - start:.3f} s (after the 8-request warm-up)"]
    elif args.multiprocess:
        lines = engine_process_report(llm, prompts, params, Path(args.out).with_suffix(".traces"))
    else:
        lines = in_process_report(llm, prompts, params)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    output_tokens = sum(p.max_tokens or 0 for p in params)
    lines.append(f"wall without profilers {wall:.3f} s, {output_tokens / wall:.0f} output tokens/s")
    Path(args.out).write_text("\n".join([header, *lines]))
    print("\n".join([header, *lines[:4], lines[-1]]))
    llm.shutdown()


def engine_process_report(llm: LLM, prompts: list, params: list, trace_dir: Path) -> list[str]:
    """torch.profiler in the engine-core process around one run of the workload: the device's
    busy share of the profiled wall time, the top ops, the trace's path."""
    stats_before = llm.get_stats()
    llm.start_profile(str(trace_dir))
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    [summary] = llm.stop_profile()
    times = engine_step_times(stats_before, llm.get_stats())
    steps = times["num_steps"]
    busy = summary["device_busy_s"]
    busy_line = "device busy: none recorded (a CPU worker)"
    if busy is not None:
        busy_line = (
            f"device busy (union of kernel intervals) {busy:.3f} s = {100 * busy / summary['wall_s']:.1f}% of the "
            f"engine's profiled {summary['wall_s']:.3f} s"
        )
    return [
        f"wall {wall:.3f} s (under the profiler, engine core in its own process), {steps} steps, "
        f"{1e3 * wall / max(steps, 1):.3f} ms/step",
        busy_line,
        summary["device_idle"] or "",
        f"engine's own time (schedule + update) {times['engine_overhead_us_per_step']:.0f} us/step",
        f"trace {summary['trace']}",
        summary["table"],
    ]


def in_process_report(llm: LLM, prompts: list, params: list) -> list[str]:
    """torch.profiler and then cProfile around a run of the workload each, in this process."""
    lines = []
    stats_before = llm.get_stats()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    times = engine_step_times(stats_before, llm.get_stats())
    steps = times["num_steps"]
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    lines.append(f"wall {wall:.3f} s (under the profiler), {steps} steps, {1e3 * wall / max(steps, 1):.3f} ms/step")
    lines.append(f"device kernel time {kernel_us / 1e6:.3f} s = {100 * kernel_us / 1e6 / wall:.1f}% of wall")
    busy_s = device_busy_s(prof)
    lines.append(f"device busy (union of kernel intervals) {busy_s:.3f} s = {100 * busy_s / wall:.1f}% of wall")
    lines.append(device_idle_report(prof))
    lines.append(f"engine's own time (schedule + update) {times['engine_overhead_us_per_step']:.0f} us/step")
    lines.append(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
    lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    lines.append(f"wall under cProfile {time.perf_counter() - start:.3f} s")
    buffer = io.StringIO()
    pstats.Stats(profiler, stream=buffer).sort_stats("tottime").print_stats(40)
    lines.append(buffer.getvalue())
    return lines


def _key_values(pairs: list[str]) -> dict[str, object]:
    """KEY=VALUE arguments as a dict, values read as bools or ints where they are."""
    return {key: _value(value) for key, value in (pair.split("=", 1) for pair in pairs)}


def _value(text: str) -> object:
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        return text


if __name__ == "__main__":
    main()
