#!/usr/bin/env bash
# Where the time goes, in one call of about 7 minutes on one H200: torch.profiler + cProfile of
# the Llama-3.1-8B shape on the nano-vllm protocol (with the decode attention's shipped split rule,
# and with contexts split up to 16 programs per SM whatever the grid, the rule before 2026-12-01),
# at batch 1, and of the Qwen3-0.6B shape on the nano-vllm protocol; the sampling and GEMV kernel
# benchmarks. Results land in $OUT/profiles.tgz, summaries are printed.
#   run(command="bash tests/gpu/run_profiles.sh", carry=[".whl", "shoal/_C.so", "shoal/_C.so.json"])
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source .whl/prelude.sh || exit 1
OUT=${OUT:-/tmp/shoal-profiles}
RESULTS=/tmp/shoal-profile-results
rm -rf "$RESULTS"; mkdir -p "$RESULTS" "$OUT"
python3 -m shoal.kernels.build 2>&1 | tail -1
profile() {  # profile NAME MODEL ARGS...
  local name=$1 model=$2; shift 2
  timeout 150 python3 tests/gpu/profile_steps.py --model "benchmarks/configs/$model" --out "$RESULTS/profile_$name.txt" "$@" \
    2>&1 | grep -v INFO | tail -5
}
# Prefix caching off: the runs after the profiled one repeat the prompts, and their walls are the A/B.
profile llama8b_nano llama-3.1-8b --nano --engine-arg enable_prefix_caching=False
profile llama8b_nano_split16 llama-3.1-8b --nano --engine-arg enable_prefix_caching=False --decode-tuning split_below_per_sm=16
profile llama8b_b1 llama-3.1-8b --num-prompts 1 --input-len 128 --output-len 256
profile qwen06b_nano qwen3-0.6b --nano
timeout 60 python3 benchmarks/bench_sampling.py --output "$RESULTS/sampling.json" 2>&1 | tail -4
timeout 100 python3 benchmarks/bench_gemv.py --output "$RESULTS/gemv.json" 2>&1 | grep "llama-8b" | head -12
tar czf "$OUT/profiles.tgz" -C "$RESULTS" .
