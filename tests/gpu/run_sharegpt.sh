#!/usr/bin/env bash
# ShareGPT prompts on the dummy Llama-3.1-8B shape, 64 at a time: offline, then through `shoal
# serve` with streaming (tests/gpu/bench_suite.py --only sharegpt). The prompts and the Llama-3
# tokenizer come packed by `.venv/bin/python tests/gpu/stage_sharegpt.py`:
#   run(command="bash tests/gpu/run_sharegpt.sh",
#       carry=[".whl", ".gpu-stage/sharegpt.tgz", "shoal/_C.so", "shoal/_C.so.json"])
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source .whl/prelude.sh || exit 1
[ -d .gpu-stage/sharegpt ] || tar xzf .gpu-stage/sharegpt.tgz -C .gpu-stage || exit 1
OUT=${OUT:-/tmp/shoal-sharegpt}
mkdir -p "$OUT"
timeout -s INT -k 30 "${SHOAL_BENCH_TIMEOUT_S:-420}" python3 tests/gpu/bench_suite.py --out "$OUT" \
  --only sharegpt --sharegpt-dir .gpu-stage/sharegpt 2>&1 | tee "$OUT/sharegpt.log" | grep -A12 "^summary"
