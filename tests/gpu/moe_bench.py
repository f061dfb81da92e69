"""The mixture-of-experts benchmarks on one H200 (tests/gpu/run_moe.sh runs them), with
tests/gpu/bench_suite.py's machinery and protocol:

1. `qwen3_30b_a3b`: the Qwen3-30B-A3B shape (benchmarks/configs/qwen3-30b-a3b, 128 experts, top
   8, dummy bf16 weights, max_model_len 4096): seconds to a ready engine (weights, profiling,
   the fused-MoE warm-up, CUDA graphs), then the nano-vllm protocol (256 requests of 100-1024
   random tokens in and out). Goal: >= 7,700 output tok/s.
2. `qwen3_30b_a3b_serve`: `shoal serve` of the same shape: seconds from the command to the first
   200 from /health (goal: < 60 s) and to the first completion, then 256 x (512 in, 128 out).

    python3 tests/gpu/moe_bench.py --out $OUT [--only qwen3_30b_a3b qwen3_30b_a3b_serve]
    python3 tests/gpu/moe_bench.py --out /tmp/x --smoke TINY_MOE_DIR   # the same on CPU, tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shoal.bench.common import prepare_offline  # noqa: E402
from shoal.bench.report import print_lines  # noqa: E402
from tests.gpu.bench_suite import CONFIGS, H200, Suite, serve, smoke_plan, throughput_step  # noqa: E402

MOE_PLAN = dataclasses.replace(H200, big_model=CONFIGS / "qwen3-30b-a3b", big_label="qwen3_30b_a3b")
OUTPUT_TOKENS_PER_S_GOAL = 7700
READY_S_GOAL = 60


def moe_model(suite: Suite) -> None:
    """Engine start (timed), then the nano-vllm protocol."""
    plan = suite.plan
    setup = prepare_offline(suite.engine_args(plan.big_model), measure_bound=True, in_process=False)
    if setup.ceilings is not None:
        suite.row("device", "copy GB/s", setup.ceilings.copy_bytes_per_s / 1e9, note=setup.ceilings.device_name)
    start = time.perf_counter()
    llm = setup.create_llm()
    engine_start_s = time.perf_counter() - start
    label = plan.big_label
    suite.row(label, "engine start s", engine_start_s, note=f"goal < {READY_S_GOAL} s; dummy {plan.dtype}")
    try:
        vocab_size = setup.config.model_config.vocab_size
        extra = {"engine_start_s": engine_start_s, "goal_output_tokens_per_s": OUTPUT_TOKENS_PER_S_GOAL}
        throughput_step(suite, setup, llm, suite.nano(vocab_size), f"{label}_nano", extra)
    finally:
        llm.shutdown()


STEPS = {"qwen3_30b_a3b": moe_model, "qwen3_30b_a3b_serve": serve}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="+", choices=list(STEPS), default=list(STEPS))
    parser.add_argument("--smoke", type=Path, default=None, help="a tiny MoE model folder: the same steps on CPU")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plan = dataclasses.replace(smoke_plan(args.smoke), big_label="smoke_moe") if args.smoke else MOE_PLAN
    suite = Suite(args.out, plan)
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
