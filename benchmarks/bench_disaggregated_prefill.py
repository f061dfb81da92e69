"""Chunked prefill against prefill/decode disaggregation: the same `shoal bench serve` load on
`shoal serve` with one engine (chunked prefill mixes long prompts into the decodes' steps) and on
`shoal serve --disaggregate prefill=1,decode=1` (prompts on one engine, decodes on the other, KV
moved between them), as the seed's disaggregated-prefill benchmark compared them.

    python benchmarks/bench_disaggregated_prefill.py MODEL --input-len 2048 --output-len 128 \\
        --num-prompts 200 --request-rate 2 --output-dir results/pd
    # one GPU shared by both engines (half the memory each), the transfers through CUDA IPC:
    python benchmarks/bench_disaggregated_prefill.py MODEL --disagg-args "--gpu-memory-utilization 0.45"

Each server is started, waited for (`--ready-timeout`), loaded, and stopped; the reports land in
`--output-dir` (`chunked.json`, `disaggregated.json`) and a table compares TTFT, TPOT, ITL and
throughput. The figures of a run on the GPU go in BENCHMARKS.md; on CPU the script runs end to end
with a tiny model (what CI can check), its figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

MODES = {
    "chunked": [],
    "disaggregated": ["--disaggregate", "prefill=1,decode=1"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", default="inf", help="Poisson arrivals per second (inf: all at once)")
    parser.add_argument("--serve-args", default="", help="flags both servers get, e.g. '--max-model-len 4096'")
    parser.add_argument("--chunked-args", default="", help="flags of the chunked-prefill server only")
    parser.add_argument("--disagg-args", default="", help="flags of the disaggregated server only")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--output-dir", default="pd-bench")
    args = parser.parse_args()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    reports = {mode: run_mode(args, mode, output_dir / f"{mode}.json") for mode in args.modes}
    print_comparison(reports)


def run_mode(args: argparse.Namespace, mode: str, report_path: Path) -> dict:
    extra = args.chunked_args if mode == "chunked" else args.disagg_args
    serve = [sys.executable, "-m", "shoal", "serve", args.model, "--port", str(args.port), *MODES[mode]]
    serve += shlex.split(args.serve_args) + shlex.split(extra)
    bench = [sys.executable, "-m", "shoal", "bench", "serve", "--base-url", f"http://127.0.0.1:{args.port}"]
    bench += ["--ready-timeout", str(args.ready_timeout), "--dataset", "fixed", "--input-len", str(args.input_len)]
    bench += ["--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts)]
    bench += ["--request-rate", str(args.request_rate), "--output-json", str(report_path)]
    print("$", shlex.join(serve), flush=True)
    server = subprocess.Popen(serve, start_new_session=True)
    try:
        print("$", shlex.join(bench), flush=True)
        subprocess.run(bench, check=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    return json.loads(report_path.read_text())


def print_comparison(reports: dict[str, dict]) -> None:
    print(f"{'mode':<15} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p99':>8}")
    for mode, report in reports.items():
        run = report["runs"][0]
        print(
            f"{mode:<15} {run['requests_per_s']:>7.2f} {run['output_tokens_per_s']:>10.1f} "
            f"{run['ttft_ms']['p50']:>9.1f} {run['ttft_ms']['p99']:>9.1f} {run['tpot_ms']['p50']:>9.2f} "
            f"{run['itl_ms']['p99']:>8.2f}"
        )


if __name__ == "__main__":
    main()
