#!/usr/bin/env bash
# sleep / wake_up on one GPU, in one call: build the CUDA ops (the VMM allocator of
# enable_sleep_mode lives in csrc/sleep_memory.cu), run the allocator's and the engine's GPU
# tests for both address strategies (tests/kernels/test_sleep_memory.py, tests/gpu/test_sleep_gpu.py),
# then measure both strategies on an 8B-shaped model (tests/gpu/sleep_wake.py).
# Into $OUT: build.log, pytest-sleep.log, sleep_wake.log and sleep_wake.json; the table is printed.
#   run(command="bash tests/gpu/run_sleep_wake.sh", carry=[".whl", "shoal/_C.so", "shoal/_C.so.json"])
# (a carried library built from this csrc/ skips the build.) Extra arguments go to sleep_wake.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
source .whl/prelude.sh || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/shoal-sleep-out}
mkdir -p "$OUT"
status=0
python3 -m shoal.kernels.build --build-dir "${SHOAL_BUILD_DIR:-/tmp/shoal-build}" > "$OUT/build.log" 2>&1 || status=1
tail -1 "$OUT/build.log"
cp shoal/_C.so shoal/_C.so.json "$OUT/" 2>/dev/null
python3 -m pytest -v -m gpu -p no:cacheprovider -rfE tests/kernels/test_sleep_memory.py tests/gpu/test_sleep_gpu.py \
  > "$OUT/pytest-sleep.log" 2>&1 || status=1
grep -E "(PASSED|FAILED|ERROR)|^=+ .*(passed|failed|error)" "$OUT/pytest-sleep.log" | tail -15
python3 tests/gpu/sleep_wake.py --output "$OUT/sleep_wake.json" "$@" 2>&1 | tee "$OUT/sleep_wake.log" | tail -22
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "run_sleep_wake status=$status"
exit $status
