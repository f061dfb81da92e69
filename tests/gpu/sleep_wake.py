"""sleep / wake_up on one GPU, measured for both ways of getting the memory back, in one run:

- keep_addresses: `enable_sleep_mode=True`; weights and KV cache live in the VMM allocator's
  pools (csrc/sleep_memory.cu), sleep unmaps their physical memory, wake-up maps new memory at
  the same addresses and the CUDA graphs replay as captured;
- recapture: `enable_sleep_mode=False`; sleep empties the storages (to pinned host memory for
  the weights), wake-up refills them at new addresses and captures the CUDA graphs again.

Each strategy runs in its own process (an engine's pools and pinned memory must not colour the
other's figures), on an 8B-shaped model with dummy weights (benchmarks/configs/llama-3.1-8b) by
default. Per strategy: the engine's GPU memory as the driver sees it (`torch.cuda.mem_get_info`
before and after start-up), what sleep(level=1) frees of it (the bar: 90%), what wake_up gives
back, sleep and wake times (the first sleep pins host memory; the second reuses it), waking the
tags one at a time, a level-2 cycle, greedy outputs before and after (identical), CUDA-graph
replays after the wake-up, and decode throughput before and after.

    python3 tests/gpu/sleep_wake.py --output $OUT/sleep_wake.json      # prints a table too

Exit status 0 only when both strategies met the bars.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

STRATEGIES = {"keep_addresses": True, "recapture": False}
DEFAULT_CONFIG = ROOT / "benchmarks" / "configs" / "llama-3.1-8b"
FREED_BAR = 0.9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_CONFIG, help="a folder with a config.json")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--strategy", choices=list(STRATEGIES), help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--child-output", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


# ---- one strategy, in a child process -----------------------------------------------------------


def free_bytes() -> int:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def timed(fn: Any, *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from shoal import LLM, SamplingParams

    torch.cuda.init()
    baseline = free_bytes()
    start = time.perf_counter()
    llm = LLM(
        str(args.model),
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        multiprocess=False,
        max_model_len=2048,
        max_num_seqs=64,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_sleep_mode=STRATEGIES[args.strategy],
    )
    start_s = time.perf_counter() - start
    worker = llm.engine_core.core.executor.worker
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(rng.randrange(16, 256))]}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def generate() -> tuple[list[list[int]], float]:
        begin = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        return [o.outputs[0].token_ids for o in outputs], args.num_prompts * args.max_tokens / seconds

    generate()  # warm-up
    expected, tokens_per_s_before = generate()
    awake = free_bytes()
    engine_bytes = baseline - awake
    graphs_before = worker.model_runner.cuda_graphs
    weight_ptr = next(worker.model_runner.model.parameters()).data_ptr()

    first_sleep_s = timed(llm.sleep, 1)
    asleep = free_bytes()
    wake_s = timed(llm.wake_up)
    woken = free_bytes()
    same_weight_address = next(worker.model_runner.model.parameters()).data_ptr() == weight_ptr
    replays: list[int] = []
    graphs = worker.model_runner.cuda_graphs
    replay = graphs.replay
    graphs.replay = lambda size: (replays.append(size), replay(size))[1]
    tokens, tokens_per_s_after = generate()

    second_sleep_s = timed(llm.sleep, 1)
    wake_weights_s = timed(llm.wake_up, ["weights"])
    wake_kv_cache_s = timed(llm.wake_up, ["kv_cache"])
    level2_sleep_s = timed(llm.sleep, 2)
    level2_asleep = free_bytes()
    level2_wake_s = timed(llm.wake_up)
    result = {
        "strategy": args.strategy,
        "keeps_addresses": worker.sleeper.strategy.keeps_addresses,
        "start_s": start_s,
        "engine_gib": engine_bytes / 2**30,
        "kv_cache_gib": worker.resident_bytes()["kv_cache"] / 2**30,
        "freed_gib": (asleep - awake) / 2**30,
        "freed_fraction": (asleep - awake) / engine_bytes,
        "level2_freed_fraction": (level2_asleep - awake) / engine_bytes,
        "restored_fraction": (asleep - woken) / (asleep - awake),
        "first_sleep_s": first_sleep_s,
        "second_sleep_s": second_sleep_s,
        "wake_s": wake_s,
        "wake_weights_s": wake_weights_s,
        "wake_kv_cache_s": wake_kv_cache_s,
        "level2_sleep_s": level2_sleep_s,
        "level2_wake_s": level2_wake_s,
        "identical_outputs": tokens == expected,
        "graph_replays_after_wake": len(replays),
        "same_graphs": graphs is graphs_before,
        "same_weight_address": same_weight_address,
        "decode_tokens_per_s_before": tokens_per_s_before,
        "decode_tokens_per_s_after": tokens_per_s_after,
    }
    llm.shutdown()
    return result


# ---- the run: both strategies, the table ----------------------------------------------------------


def run_child(args: argparse.Namespace, strategy: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        child_output = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--strategy", strategy, "--child-output", str(child_output)]
        command += ["--model", str(args.model), "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        command += ["--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens)]
        completed = subprocess.run(command, env=os.environ.copy())
        if completed.returncode != 0 or not child_output.exists():
            return {"strategy": strategy, "error": f"exit code {completed.returncode}"}
        return json.loads(child_output.read_text())


def passed(result: dict[str, Any]) -> bool:
    return (
        "error" not in result
        and result["freed_fraction"] >= FREED_BAR
        and result["identical_outputs"]
        and result["graph_replays_after_wake"] > 0
        and result["keeps_addresses"] == STRATEGIES[result["strategy"]]
    )


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        ("engine GiB", "engine_gib", "{:.1f}"),
        ("KV cache GiB", "kv_cache_gib", "{:.1f}"),
        ("freed by sleep(1)", "freed_fraction", "{:.1%}"),
        ("freed by sleep(2)", "level2_freed_fraction", "{:.1%}"),
        ("restored by wake_up", "restored_fraction", "{:.1%}"),
        ("first sleep(1) s", "first_sleep_s", "{:.2f}"),
        ("second sleep(1) s", "second_sleep_s", "{:.2f}"),
        ("wake_up s", "wake_s", "{:.2f}"),
        ("wake_up(weights) s", "wake_weights_s", "{:.2f}"),
        ("wake_up(kv_cache) s", "wake_kv_cache_s", "{:.2f}"),
        ("sleep(2) s", "level2_sleep_s", "{:.2f}"),
        ("wake_up after sleep(2) s", "level2_wake_s", "{:.2f}"),
        ("identical greedy outputs", "identical_outputs", "{}"),
        ("graph replays after wake", "graph_replays_after_wake", "{}"),
        ("same graphs / addresses", ("same_graphs", "same_weight_address"), "{} / {}"),
        ("decode tok/s before", "decode_tokens_per_s_before", "{:.0f}"),
        ("decode tok/s after", "decode_tokens_per_s_after", "{:.0f}"),
        ("passed", None, "{}"),
    ]
    lines = [f"{'':28}" + "".join(f"{r['strategy']:>18}" for r in results)]
    for label, key, fmt in rows:
        cells = []
        for result in results:
            if "error" in result:
                cells.append(result["error"] if key is None else "-")
            elif key is None:
                cells.append(fmt.format(passed(result)))
            elif isinstance(key, tuple):
                cells.append(fmt.format(*(result[k] for k in key)))
            else:
                cells.append(fmt.format(result[key]))
        lines.append(f"{label:28}" + "".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    if args.strategy is not None:
        args.child_output.write_text(json.dumps(measure(args)))
        return 0
    results = [run_child(args, strategy) for strategy in STRATEGIES]
    print(table(results))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"model": str(args.model), "results": results}, indent=2))
    return 0 if all(passed(r) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
