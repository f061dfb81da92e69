#!/usr/bin/env bash
# The benchmark suite after a change on the hot path, in one call of at most ten minutes on one
# H200 (tests/gpu/run_bench.sh): the figures BENCHMARKS.md compares. The tests are `make test-gpu`'s
# (docs/gpu-tests.md); profiles are tests/gpu/run_profiles.sh's. Carry a built shoal/_C.so
# (+ .json stamp) to skip the CUDA build. The results come back in $OUT (bench_results.tgz,
# bench_suite.log); the bench table is printed.
#   run(command="bash tests/gpu/final_run.sh", carry=[".whl", "shoal/_C.so", "shoal/_C.so.json"])
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source .whl/prelude.sh || exit 1
OUT=${OUT:-/tmp/shoal-final}
mkdir -p "$OUT"
python3 -m shoal.kernels.build 2>&1 | tail -1
# The bench gets what the device call's 600 s leave (it needs ~160 s; at its limit it is
# interrupted and still prints its summary).
bench_s=$(( 585 - SECONDS )); (( bench_s > 420 )) && bench_s=420
SHOAL_BENCH_TIMEOUT_S=${SHOAL_BENCH_TIMEOUT_S:-$bench_s} bash tests/gpu/run_bench.sh 2>&1 | grep -A40 "^summary"
