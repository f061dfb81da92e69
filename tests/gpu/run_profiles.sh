#!/usr/bin/env bash
# Where the time goes, in one call of about 8 minutes on one H200: torch.profiler + cProfile of
# the Llama-3.1-8B shape on the nano-vllm protocol and at batch 1, and of the Qwen3-0.6B shape on
# the nano-vllm protocol; the Qwen3-0.6B nano run with and without SHOAL_FUSED_SAMPLING; the decode
# attention sweep over a 100 GiB cache (blocks scattered as in the engine). Results land in
# $OUT/profiles.tgz, summaries are printed.
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
profile llama8b_nano llama-3.1-8b --nano
profile llama8b_b1 llama-3.1-8b --num-prompts 1 --input-len 128 --output-len 256
profile qwen06b_nano qwen3-0.6b --nano
for fused in 0 1; do
  mkdir -p "$RESULTS/fused_sampling_$fused"
  SHOAL_FUSED_SAMPLING=$fused timeout 100 python3 tests/gpu/bench_suite.py --out "$RESULTS/fused_sampling_$fused" \
    --only qwen06b 2>&1 | grep -A3 "^summary"
done
timeout 100 python3 benchmarks/sweep_attention.py --cache-gib 100 --output "$RESULTS/sweep_decode_100gib.json" 2>&1 | tail -12
tar czf "$OUT/profiles.tgz" -C "$RESULTS" .
