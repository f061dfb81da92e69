#!/usr/bin/env bash
# Everything shoal checks on the GPU machine in one call: the kernel suite (build, tests,
# benchmarks), then the GPU model tests. Logs are packed into $OUT/logs.tgz (the device tool
# brings back at most 8 files); the built library and the JSON results are copied beside it.
#   source .whl/prelude.sh && bash tests/gpu/run_all.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=/tmp/shoal-results
rm -rf "$RESULTS"; mkdir -p "$RESULTS"
OUT_FINAL=${OUT:-/tmp/shoal-out}
OUT=$RESULTS SHOAL_SUITE_STEPS=${SHOAL_SUITE_STEPS:-build test bench} bash tests/gpu/run_gpu_suite.sh
suite=$?
python3 -m pytest -q -m gpu tests/gpu ${SHOAL_GPU_TESTS_ARGS:-} -p no:cacheprovider -ra --durations=10 \
  2>&1 | tee "$RESULTS/pytest-gpu-models.log"
models=${PIPESTATUS[0]}
tar czf "$OUT_FINAL/logs.tgz" -C "$RESULTS" $(cd "$RESULTS" && ls | grep -v '^_C')
for f in _C.so _C.so.json bench_kernels.json; do [ -f "$RESULTS/$f" ] && cp "$RESULTS/$f" "$OUT_FINAL/"; done
echo "suite rc=$suite models rc=$models"
