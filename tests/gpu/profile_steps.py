"""Where a step's time goes on the GPU machine: device busy share and host hot spots.

Runs one offline workload twice on one engine (dummy weights of a real shape) after a warm-up:
under torch.profiler (the device's kernel time against the wall time: the share the device was
busy, and the top kernels) and under cProfile (the host's Python functions by own time).

    python3 tests/gpu/profile_steps.py --model benchmarks/configs/qwen3-0.6b --num-prompts 256 \
        --input-len 512 --output-len 64 --out $OUT/profile_qwen06b.txt
    python3 tests/gpu/profile_steps.py --model benchmarks/configs/llama-3.1-8b --nano --out nano.txt
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
from shoal.bench.workloads import fixed_lengths, random_nano


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
    args = parser.parse_args()
    extra = _key_values(args.engine_arg)
    if args.decode_tuning:  # the engine runs in this process (multiprocess=False), so this reaches it
        from shoal.kernels.triton import paged_attention as tpa

        tpa.DECODE_TUNING = dataclasses.replace(tpa.DECODE_TUNING, **_key_values(args.decode_tuning))
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=4096, multiprocess=False, **extra)
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
    stats = llm.get_stats()
    steps = stats["num_steps"] - stats_before["num_steps"]
    own = (stats["step_s"] - stats_before["step_s"]) - (stats["execute_model_s"] - stats_before["execute_model_s"])
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    lines.append(f"workload {workload.describe()}, engine args {extra}, decode tuning {args.decode_tuning}")
    lines.append(f"wall {wall:.3f} s (under the profiler), {steps} steps, {1e3 * wall / max(steps, 1):.3f} ms/step")
    lines.append(f"device kernel time {kernel_us / 1e6:.3f} s = {100 * kernel_us / 1e6 / wall:.1f}% of wall")
    busy_s = _device_busy_s(prof)
    lines.append(f"device busy (union of kernel intervals) {busy_s:.3f} s = {100 * busy_s / wall:.1f}% of wall")
    lines.append(f"engine's own time (schedule + update) {1e6 * own / max(steps, 1):.0f} us/step")
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
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    lines.append(f"wall without profilers {time.perf_counter() - start:.3f} s")
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines[:4] + lines[-1:]))


def _device_busy_s(prof: torch.profiler.profile) -> float:
    """Seconds in which some kernel or copy ran on the device: the union of their intervals (the
    per-name tables list an eagerly launched kernel under its op as well, so sums overcount)."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    busy_us, covered_until = 0.0, float("-inf")
    for start, end in intervals:
        if end > covered_until:
            busy_us += end - max(start, covered_until)
            covered_until = end
    return busy_us / 1e6


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
