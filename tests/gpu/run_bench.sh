#!/usr/bin/env bash
# shoal's benchmarks on one H200 in one call of about 5 minutes (tests/gpu/bench_suite.py):
# Llama-3.1-8B shape with dummy bf16 weights (nano-vllm protocol, 1000 x (1024 in, 128 out),
# batch-1 latency 128 in / 512 out, 64 x (512 in, 128 out) against transformers), the Qwen3-0.6B
# shape on the nano-vllm protocol, `shoal serve`'s ready-to-answer time with dummy 8B weights, and
# first the host's work per decode step on this machine's CPU (benchmarks/bench_host_step.py).
# Each result JSON lands in $RESULTS as soon as its run ends; at the end they are packed into
# $OUT/bench_results.tgz (the device tool brings back at most 8 files) beside bench_suite.log; the
# summary table is printed last.
#   bash tests/gpu/run_bench.sh          # (sources .whl/prelude.sh itself when it is there)
# SHOAL_BENCH_STEPS="host_step llama8b qwen06b serve" picks steps; SHOAL_BENCH_TIMEOUT_S (330) caps the
# suite: at the cap it is interrupted, shuts its engines down and still prints the summary.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -f .whl/prelude.sh ]; then source .whl/prelude.sh || exit 1; fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/shoal-bench-out}
RESULTS=${SHOAL_BENCH_RESULTS:-/tmp/shoal-bench-results}
rm -rf "$RESULTS"; mkdir -p "$RESULTS" "$OUT"
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' || exit 1
steps=()
if [ -n "${SHOAL_BENCH_STEPS:-}" ]; then steps=(--only ${SHOAL_BENCH_STEPS}); fi
timeout -s INT -k 30 "${SHOAL_BENCH_TIMEOUT_S:-330}" python3 tests/gpu/bench_suite.py --out "$RESULTS" "${steps[@]}" 2>&1 \
  | tee "$RESULTS/bench_suite.log"
rc=${PIPESTATUS[0]}
tar czf "$OUT/bench_results.tgz" -C "$RESULTS" . && cp "$RESULTS/bench_suite.log" "$OUT/"
ls -l "$RESULTS"
echo "bench suite rc=$rc"
exit "$rc"
