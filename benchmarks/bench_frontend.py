"""Frontend + IPC overhead: the same offline workload through the multiprocess client (the
engine core in its own process, ZeroMQ + msgspec) and the in-process client, in one run; and
the engine loop's own time per step outside `execute_model` (schedule + update + IPC-free
bookkeeping), measured in-process.

    .venv/bin/python benchmarks/bench_frontend.py [--model DIR] [--num-prompts 64] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from shoal import LLM, SamplingParams


def workload(num_prompts: int, prompt_len: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(prompt_len)]} for _ in range(num_prompts)]


def run(llm: LLM, prompts: list[dict], params: SamplingParams) -> float:
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def engine_overhead_per_step(llm: LLM, prompts: list[dict], params: SamplingParams) -> dict:
    """Time of EngineCore.step minus time inside execute_model, per step (in-process client)."""
    core = llm.engine_core.core
    inner, outer = [], []
    execute, step = core.executor.execute_model, core.step

    def timed_execute(*args, **kwargs):
        start = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            inner.append(time.perf_counter() - start)

    def timed_step():
        start = time.perf_counter()
        try:
            return step()
        finally:
            outer.append(time.perf_counter() - start)

    core.executor.execute_model, core.step = timed_execute, timed_step
    llm.generate(prompts, params, use_tqdm=False)
    overhead = [o - i for o, i in zip(outer, inner)]
    return {
        "steps": len(overhead),
        "mean_us": statistics.mean(overhead) * 1e6,
        "p50_us": statistics.median(overhead) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the demo model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    prompts = workload(args.num_prompts, args.prompt_len, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    results: dict[str, list[float]] = {"multiprocess": [], "in_process": []}
    engines = {"multiprocess": LLM(args.model), "in_process": LLM(args.model, multiprocess=False)}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
        for name, llm in engines.items():
            results[name].append(run(llm, prompts, params))
    best = {name: max(values) for name, values in results.items()}
    report = {
        "output_tokens_per_s": best,
        "ratio_multiprocess_to_in_process": best["multiprocess"] / best["in_process"],
        "engine_overhead_per_step": engine_overhead_per_step(engines["in_process"], prompts, params),
        "workload": vars(args),
    }
    for llm in engines.values():
        llm.shutdown()
    print(json.dumps(report, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
