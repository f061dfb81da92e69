"""The latency of one 32-token greedy request on the CPU against the engine's torch thread count,
on an idle machine and next to one busy neighbour process (a core-bound loop), measured
interleaved: one engine per thread count, all started at once (each in its own engine-core
process, as `LLM()` runs), then round after round every (thread count, neighbour) case once, so
that whatever else the machine does falls on every case alike.

    python3 benchmarks/bench_cpu_threads.py --threads 1 2 --rounds 5 --output cpu_threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal import LLM, SamplingParams
from shoal.workers.cpu_threads import default_cpu_threads, usable_physical_cores

PROMPT = "The capital of France is"
PARAMS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# A neighbour that keeps one core busy, as a second job on the machine would.
NEIGHBOUR = "while True: pass"


def start_engine(model: str | None, num_threads: int) -> LLM:
    os.environ["SHOAL_CPU_THREADS"] = str(num_threads)  # the engine-core process reads it at start
    return LLM(model, device="cpu", max_model_len=256, kv_cache_memory_bytes=64 * 2**20, max_num_seqs=4)


def time_request(llm: LLM) -> float:
    start = time.perf_counter()
    (output,) = llm.generate(PROMPT, PARAMS, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == PARAMS.max_tokens
    return time.perf_counter() - start


def measure(engines: dict[int, LLM], rounds: int) -> dict[str, list[float]]:
    """Seconds per request, by case ("<threads> threads, idle|busy neighbour")."""
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for busy in (False, True):
            neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if busy else None
            try:
                time.sleep(0.5 if busy else 0.0)  # the neighbour is up and spinning
                for num_threads, llm in engines.items():
                    case = f"{num_threads} threads, {'busy' if busy else 'idle'} neighbour"
                    times.setdefault(case, []).append(time_request(llm))
                    print(f"{case}: {times[case][-1]:.2f} s", flush=True)
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder; none: the demo model")
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, usable_physical_cores()}))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    engines = {n: start_engine(args.model, n) for n in args.threads}
    try:
        for llm in engines.values():
            time_request(llm)  # warm-up
        times = measure(engines, args.rounds)
    finally:
        for llm in engines.values():
            llm.shutdown()
    report = {
        "physical_cores": usable_physical_cores(),
        "default_cpu_threads": default_cpu_threads(),
        "load_average_1m": os.getloadavg()[0],
        "cases": {
            case: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "runs_s": t}
            for case, t in times.items()
        },
    }
    for case, stats in report["cases"].items():
        print(f"{case:32s} median {stats['median_s']:6.2f} s  (min {stats['min_s']:.2f}, max {stats['max_s']:.2f})")
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
