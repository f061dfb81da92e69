#!/usr/bin/env bash
# Where the time goes, in one call of about 6 minutes on one H200: torch.profiler + cProfile of
# the Llama-3.1-8B shape on the nano-vllm protocol, on 400 x (1024 in, 128 out) (the steady state
# of the 1000-prompt run: a few prompts prefilled next to ~250 decodes each step) and at batch 1,
# and of the Qwen3-0.6B shape on the nano-vllm protocol (in this process, and in the engine-core
# process as the bench runs it); the attention kernels on mixed batches
# (benchmarks/bench_attention_mixed.py), on fresh prompts against PyTorch's flash attention
# (benchmarks/bench_prefill_attention.py) and on decode batches in three request orders
# (benchmarks/sweep_attention.py --kernel order). Results land in $OUT/profiles.tgz, summaries are printed.
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
timeout 120 python3 benchmarks/bench_attention_mixed.py --output "$RESULTS/attention_mixed.json" 2>&1 | tail -4
timeout 120 python3 benchmarks/bench_prefill_attention.py --output "$RESULTS/prefill_attention.json" 2>&1 | tail -8
timeout 120 python3 benchmarks/sweep_attention.py --kernel order --cache-gib 100 --output "$RESULTS/decode_order.json" \
  2>&1 | tail -4
# Prefix caching off: the runs after the profiled one repeat the prompts, and their walls count.
profile llama8b_nano llama-3.1-8b --nano --engine-arg enable_prefix_caching=False
profile llama8b_400x1024 llama-3.1-8b --num-prompts 400 --input-len 1024 --output-len 128 \
  --engine-arg enable_prefix_caching=False
profile llama8b_b1 llama-3.1-8b --num-prompts 1 --input-len 128 --output-len 256
profile qwen06b_nano qwen3-0.6b --nano --engine-arg enable_prefix_caching=False
# As the bench runs it (engine core in its own process): how long the device waits for the host.
profile qwen06b_nano_engine_process qwen3-0.6b --nano --multiprocess
rm -rf "$RESULTS"/*.traces  # Chrome traces of whole runs: too large to bring back
tar czf "$OUT/profiles.tgz" -C "$RESULTS" .
