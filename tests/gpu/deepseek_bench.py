"""The DeepSeek benchmarks on one H200 (tests/gpu/run_deepseek.sh runs them), with
tests/gpu/bench_suite.py's machinery and protocol: seconds to a ready engine, then the nano-vllm
protocol (256 requests of 100-1024 random tokens in and out, max_model_len 4096), dummy weights:

1. `deepseek_v2_lite`: benchmarks/configs/deepseek-v2-lite (MLA with 16 heads, 64 experts top 6,
   2 shared), bf16.
2. `deepseek_v3_8layer`: benchmarks/configs/deepseek-v3-8layer (3 dense + 5 MoE layers of
   DeepSeek-V3, 256 experts top 8), block fp8 as the checkpoint declares it.

Their peer figures come later; the reports carry the share of the hardware bound.

    python3 tests/gpu/deepseek_bench.py --out $OUT [--only deepseek_v2_lite]
    python3 tests/gpu/deepseek_bench.py --out /tmp/x --smoke TINY_DEEPSEEK_DIR   # on CPU, tiny
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
from tests.gpu.bench_suite import CONFIGS, H200, Suite, smoke_plan, throughput_step  # noqa: E402

MODELS = {"deepseek_v2_lite": CONFIGS / "deepseek-v2-lite", "deepseek_v3_8layer": CONFIGS / "deepseek-v3-8layer"}


def nano_run(suite: Suite, label: str, model: Path) -> None:
    """Engine start (timed), then the nano-vllm protocol."""
    setup = prepare_offline(suite.engine_args(model), measure_bound=True, in_process=False)
    start = time.perf_counter()
    llm = setup.create_llm()
    engine_start_s = time.perf_counter() - start
    suite.row(label, "engine start s", engine_start_s, note=f"dummy, {setup.config.model_config.dtype}")
    try:
        vocab_size = setup.config.model_config.vocab_size
        throughput_step(suite, setup, llm, suite.nano(vocab_size), f"{label}_nano", {"engine_start_s": engine_start_s})
    finally:
        llm.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--smoke", type=Path, default=None, help="a tiny DeepSeek model folder: the same on CPU")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    plan = smoke_plan(args.smoke) if args.smoke else H200
    models = {name: args.smoke for name in args.only} if args.smoke else {name: MODELS[name] for name in args.only}
    suite = Suite(args.out, dataclasses.replace(plan, big_label="deepseek"))
    failures = 0
    try:
        for name, model in models.items():
            print_lines(f"==== {name} ({time.perf_counter() - suite.start:.0f} s) ====")
            try:
                nano_run(suite, name, model)
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
