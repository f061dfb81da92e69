#!/usr/bin/env bash
# One call on a GPU machine for everything at once, when device time is short: the GPU tests
# (models, CUDA graphs, fp8, the fp8 quantization kernel), then the benchmark suite. Carry a
# built shoal/_C.so (+ .json stamp) to skip the CUDA build. Results and logs: $OUT.
#   run(command="bash tests/gpu/final_run.sh", carry=[".whl", "shoal/_C.so", "shoal/_C.so.json"])
set -uo pipefail
cd "$(dirname "$0")/../.."
source .whl/prelude.sh || exit 1
OUT=${OUT:-/tmp/shoal-final}
mkdir -p "$OUT"
python3 -m shoal.kernels.build 2>&1 | tail -2
timeout -k 10 "${SHOAL_TEST_TIMEOUT_S:-130}" python3 -m pytest -q -m gpu -p no:cacheprovider -ra --durations=15 \
  tests/gpu tests/kernels/test_scaled_fp8_quant.py tests/layers/test_fp8.py tests/models/test_fp8_models.py \
  > "$OUT/pytest-gpu.log" 2>&1
echo "gpu tests rc=$?"; tail -25 "$OUT/pytest-gpu.log"
OUT=$OUT SHOAL_BENCH_TIMEOUT_S=${SHOAL_BENCH_TIMEOUT_S:-250} bash tests/gpu/run_bench.sh > /dev/null 2>&1
tail -40 "$OUT/bench_suite.log"
