#!/usr/bin/env bash
# Structured output on one H200, in one call of about 4 minutes: the GPU structured-output tests,
# then the 8B nano protocol (Llama-3.1-8B shape, dummy bf16 weights, 256 requests of U[100, 1024]
# tokens in and out, T=0.6) run twice on one engine — unconstrained, then with a JSON schema on
# every request (shoal/bench/structured.py) — printing both output tokens/s and the slowdown
# (the target: at most 10%). The report is $OUT/structured_nano.json, the logs beside it.
# Needs .whl/ with xgrammar's wheels and llama3-tokenizer.tgz: bash tests/gpu/stage_structured.sh.
#   run(command="bash tests/gpu/run_structured.sh", carry=[".whl"])
set -uo pipefail
cd "$(dirname "$0")/../.."
source .whl/prelude.sh || exit 1
OUT=${OUT:-/tmp/shoal-structured}
mkdir -p "$OUT"
# A machine prepared before the wheels were carried has /tmp/site without them.
python3 -c "import xgrammar" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
  --target /tmp/site .whl/xgrammar-*.whl .whl/apache_tvm_ffi-*.whl || exit 1
TOKENIZER=/tmp/llama3-tokenizer
if [ ! -f "$TOKENIZER/tokenizer.json" ]; then mkdir -p "$TOKENIZER" && tar xzf .whl/llama3-tokenizer.tgz -C "$TOKENIZER" || exit 1; fi
timeout -k 10 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_structured.py > "$OUT/pytest-structured.log" 2>&1
echo "structured gpu tests rc=$?"; tail -3 "$OUT/pytest-structured.log"
timeout -k 10 420 python3 -m shoal bench throughput --model benchmarks/configs/llama-3.1-8b --load-format dummy \
  --tokenizer "$TOKENIZER" --dataset random-nano --max-model-len 4096 --structured-output both \
  --output-json "$OUT/structured_nano.json" > "$OUT/structured_bench.log" 2>&1
rc=$?
grep -A8 "^throughput:" "$OUT/structured_bench.log"
python3 - "$OUT/structured_nano.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
free, constrained = report["results"]["shoal"], report["results"]["shoal+json-schema"]
slowdown = report["json_schema_slowdown"]
print(json.dumps({
    "unconstrained_output_tokens_per_s": round(free["output_tokens_per_s"], 1),
    "json_schema_output_tokens_per_s": round(constrained["output_tokens_per_s"], 1),
    "slowdown": round(slowdown, 4),
    "engine_overhead_us_per_step": [free.get("engine_overhead_us_per_step"), constrained.get("engine_overhead_us_per_step")],
    "within_10_percent": slowdown <= 0.10,
}, indent=2))
PY
exit "$rc"
