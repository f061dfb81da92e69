#!/usr/bin/env bash
# One call on a GPU machine for everything at once, when device time is short (about 8 minutes):
# the GPU test suite (all of it but the demo model, which needs tests/gpu/stage_demo_model.sh),
# the benchmark suite, then profiles of the Qwen3-0.6B and Llama-3.1-8B shapes at batch 256 and of
# the 8B shape at batch 1, and the Qwen3-0.6B nano run again with SHOAL_FUSED_SAMPLING=1. Carry a built shoal/_C.so (+ .json stamp) to skip the CUDA build.
# Everything lands in $OUT/results.tgz (the device tool brings back at most 8 files); the summary
# tables are printed.
#   run(command="bash tests/gpu/final_run.sh", carry=[".whl", "shoal/_C.so", "shoal/_C.so.json"])
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source .whl/prelude.sh || exit 1
OUT=${OUT:-/tmp/shoal-final}
RESULTS=/tmp/shoal-final-results
rm -rf "$RESULTS"; mkdir -p "$RESULTS" "$OUT"
python3 -m shoal.kernels.build 2>&1 | tail -2
timeout -k 10 "${SHOAL_TEST_TIMEOUT_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -ra --durations=15 \
  tests --deselect tests/gpu/test_gpu_demo_model.py > "$RESULTS/pytest-gpu.log" 2>&1
echo "gpu tests rc=$?"; tail -8 "$RESULTS/pytest-gpu.log"
OUT=$RESULTS SHOAL_BENCH_TIMEOUT_S=${SHOAL_BENCH_TIMEOUT_S:-240} bash tests/gpu/run_bench.sh > /dev/null 2>&1
grep -A30 "^summary" "$RESULTS/bench_suite.log"
profile() {  # profile NAME MODEL PROMPTS INPUT OUTPUT
  timeout 90 python3 tests/gpu/profile_steps.py --model "benchmarks/configs/$2" --num-prompts "$3" \
    --input-len "$4" --output-len "$5" --out "$RESULTS/profile_$1.txt" 2>&1 | grep -v INFO | tail -5
}
profile qwen06b_b256 qwen3-0.6b 256 512 64
profile llama8b_b256 llama-3.1-8b 256 512 64
profile llama8b_b1 llama-3.1-8b 1 128 256
# The one-pass sampling kernel against the general path (the suite's own qwen06b run above).
mkdir -p "$RESULTS/fused_sampling"
SHOAL_FUSED_SAMPLING=1 timeout 120 python3 tests/gpu/bench_suite.py --out "$RESULTS/fused_sampling" --only qwen06b \
  2>&1 | grep -A4 "^summary"
tar czf "$OUT/results.tgz" -C "$RESULTS" .
