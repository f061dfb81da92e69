#!/usr/bin/env bash
# The closing check of a change, in one call of about 9–10 minutes on one H200: the GPU test suite
# (all of it but the demo model, which needs tests/gpu/stage_demo_model.sh's two calls) and then
# the benchmark suite (tests/gpu/run_bench.sh). Profiles are tests/gpu/run_profiles.sh's job.
# Carry a built shoal/_C.so (+ .json stamp) to skip the CUDA build. The test log and the bench
# results come back in $OUT (pytest-gpu.log, bench_results.tgz, bench_suite.log); the test
# summary and the bench table are printed.
#   run(command="bash tests/gpu/final_run.sh", carry=[".whl", "shoal/_C.so", "shoal/_C.so.json"])
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source .whl/prelude.sh || exit 1
OUT=${OUT:-/tmp/shoal-final}
mkdir -p "$OUT"
python3 -m shoal.kernels.build 2>&1 | tail -1
# -v: each test's name and outcome as it finishes, so a run cut at the limit still says what failed.
timeout -k 10 "${SHOAL_TEST_TIMEOUT_S:-420}" python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --durations=10 \
  tests --deselect tests/gpu/test_gpu_demo_model.py > "$OUT/pytest-gpu.log" 2>&1
echo "gpu tests rc=$?"; grep -E "(FAILED|ERROR)( |$)|^=+ .*(passed|failed|error)" "$OUT/pytest-gpu.log" | tail -15
# The bench gets what the device call's 600 s leave (it needs ~160 s; at its limit it is
# interrupted and still prints its summary).
bench_s=$(( 585 - SECONDS )); (( bench_s > 270 )) && bench_s=270
SHOAL_BENCH_TIMEOUT_S=${SHOAL_BENCH_TIMEOUT_S:-$bench_s} bash tests/gpu/run_bench.sh 2>&1 | grep -A40 "^summary"
