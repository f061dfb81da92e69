#!/usr/bin/env bash
# ShareGPT prompts on the dummy Llama-3.1-8B shape, 64 at a time: offline, then through `shoal
# serve` with streaming (tests/gpu/bench_suite.py --only sharegpt). The staged folder and .whl do
# not fit one call together, so install .whl first on the same warm machine:
#   run(command="source .whl/prelude.sh", carry=[".whl"])
#   run(command="bash tests/gpu/run_sharegpt.sh", carry=[".gpu-stage/sharegpt", "shoal/_C.so", "shoal/_C.so.json"])
# (.gpu-stage/sharegpt comes from `.venv/bin/python tests/gpu/stage_sharegpt.py`.)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ -f /tmp/site/.done ] || { echo "install .whl first: source .whl/prelude.sh"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 RAY_USAGE_STATS_ENABLED=0
OUT=${OUT:-/tmp/shoal-sharegpt}
mkdir -p "$OUT"
timeout -s INT -k 30 "${SHOAL_BENCH_TIMEOUT_S:-420}" python3 tests/gpu/bench_suite.py --out "$OUT" \
  --only sharegpt --sharegpt-dir .gpu-stage/sharegpt 2>&1 | tee "$OUT/sharegpt.log" | grep -A12 "^summary"
