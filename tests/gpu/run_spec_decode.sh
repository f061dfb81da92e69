#!/usr/bin/env bash
# Speculative decoding on one GPU (docs/spec_decode.md, "Benchmarks"): output tok/s at batch 1 of
# the demo model in bf16 on the copy-heavy ShareGPT workload (each prompt asks to repeat a
# ShareGPT reply), without speculation and with n-gram prompt lookup, then the dummy 8B shape with
# the bench-only `accept_all_drafts` (k = 3) at batch 1 and 64. Stage here first:
#   .venv/bin/python tests/gpu/stage_sharegpt.py      # .gpu-stage/sharegpt.tgz (prompts + tokenizer)
#   bash tests/gpu/stage_demo_model.sh                # the demo model in two parts
# then on one warm machine, after the demo model's two unpack calls (stage_demo_model.sh):
#   run(command="source tests/gpu/stage_demo_model.sh unpack b && bash tests/gpu/run_spec_decode.sh",
#       carry=[".gpu-stage/b", ".gpu-stage/sharegpt.tgz", "shoal/_C.so", "shoal/_C.so.json"])
# Each line of $OUT/spec_decode.jsonl is one `shoal bench` report; the summary prints the ratios.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ -d .gpu-stage/sharegpt ] || tar xzf .gpu-stage/sharegpt.tgz -C .gpu-stage || exit 1
OUT=${OUT:-/tmp/shoal-spec-decode}
mkdir -p "$OUT"
DEMO=$(python3 -c "from shoal.demo_model import ensure_demo_model; print(ensure_demo_model())") || exit 1
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
ACCEPT_ALL='{"method": "ngram", "num_speculative_tokens": 3, "accept_all_drafts": true}'
copy=(--dataset sharegpt-copy --dataset-path .gpu-stage/sharegpt/sharegpt.json --num-prompts 32
      --max-num-seqs 1 --dtype bfloat16 --no-hardware-bound)
bench() {  # name, then shoal bench arguments
  local name=$1; shift
  timeout -s INT -k 30 "${SHOAL_BENCH_TIMEOUT_S:-300}" python3 -m shoal bench "$@" --output-json "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1 || echo "$name failed (see $OUT/$name.log)"
}
bench demo-plain throughput --model "$DEMO" "${copy[@]}"
bench demo-ngram throughput --model "$DEMO" "${copy[@]}" --speculative-config "$NGRAM"
for batch in 1 64; do
  shape=(latency --model "${SHOAL_8B_SHAPE:-benchmarks/configs/llama-3.1-8b}" --load-format dummy --dtype bfloat16
         --batch-size "$batch" --input-len 128 --output-len 256 --temperature 0 --no-hardware-bound)
  bench "8b-plain-b$batch" "${shape[@]}"
  bench "8b-accept-all-b$batch" "${shape[@]}" --speculative-config "$ACCEPT_ALL"
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def rate(name):
    path = out / f"{name}.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    return report.get("results", {}).get("shoal", {}).get("output_tokens_per_s")
print("summary")
for base, spec in [("demo-plain", "demo-ngram"), ("8b-plain-b1", "8b-accept-all-b1"), ("8b-plain-b64", "8b-accept-all-b64")]:
    a, b = rate(base), rate(spec)
    print(f"{spec} / {base}: {b / a:.2f}x ({b:.1f} / {a:.1f} output tok/s)" if a and b else f"{spec}: missing")
PY
