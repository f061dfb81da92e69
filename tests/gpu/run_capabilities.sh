#!/usr/bin/env bash
# The costs of multi-LoRA (docs/lora.md) and batch-invariant mode (docs/batch_invariance.md) on one
# GPU, each a ratio to the plain engine measured in the same call: the Llama-3.1-8B shape with
# dummy bf16 weights on the nano-vllm protocol (256 requests, 100-1024 tokens in and out), plain;
# 8 rank-16 adapters on every projection, requests spread evenly; 64 adapters with max_loras=16;
# batch-invariant mode; then batch-1 decode (16 requests, 128 in / 256 out, one at a time) plain
# and with 8 adapters. About 6 minutes on an H200:
#   run(command="bash tests/gpu/run_capabilities.sh", carry=[".whl", "shoal/_C.so", "shoal/_C.so.json"])
# Each run's `shoal bench` JSON lands in $OUT, the logs in $OUT/logs.tgz; the summary prints the ratios.
# SHOAL_CAP_MODEL / SHOAL_CAP_DEVICE / SHOAL_CAP_SCALE=smoke run the same steps on the CPU, tiny.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ -f .whl/prelude.sh ] && [ "${SHOAL_CAP_SCALE:-}" != smoke ]; then source .whl/prelude.sh || exit 1; fi
OUT=${OUT:-/tmp/shoal-capabilities}
mkdir -p "$OUT"
MODEL=${SHOAL_CAP_MODEL:-benchmarks/configs/llama-3.1-8b}
common=(--model "$MODEL" --load-format dummy --device "${SHOAL_CAP_DEVICE:-auto}" --no-hardware-bound)
if [ "${SHOAL_CAP_SCALE:-}" = smoke ]; then
  nano=(--dataset fixed --num-prompts 6 --input-len 32 --output-len 8)
  single=(--dataset fixed --num-prompts 2 --input-len 16 --output-len 8 --max-num-seqs 1)
  common+=(--dtype float32)
else
  python3 -m shoal.kernels.build 2>&1 | tail -1
  nano=(--dataset random-nano --num-prompts 256 --max-model-len 4096)
  single=(--dataset fixed --num-prompts 16 --input-len 128 --output-len 256 --max-num-seqs 1)
  common+=(--dtype bfloat16)
fi
lora8=(--enable-lora --num-loras 8 --lora-rank 16 --max-loras 8 --max-lora-rank 16 --lora-dir "$OUT/adapters")
lora64=(--enable-lora --num-loras 64 --lora-rank 16 --max-loras 16 --max-lora-rank 16 --lora-dir "$OUT/adapters")
# Each run gets at most SHOAL_BENCH_TIMEOUT_S (150 s) and never past the call's 570th second;
# SHOAL_CAP_STEPS="nano-plain nano-lora64" runs only the named ones.
bench() {  # name, then shoal bench throughput arguments
  local name=$1; shift
  [[ -z "${SHOAL_CAP_STEPS:-}" || " $SHOAL_CAP_STEPS " == *" $name "* ]] || return 0
  local left=$(( 570 - SECONDS )) cap=${SHOAL_BENCH_TIMEOUT_S:-150}
  (( left < cap )) && cap=$left
  (( cap > 10 )) || { echo "$name: not run (the call's time is spent)"; return 0; }
  timeout -s INT -k 15 "$cap" python3 -m shoal bench throughput "${common[@]}" "$@" \
    --output-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || echo "$name failed (see $OUT/$name.log)"
}
bench nano-plain "${nano[@]}"
bench nano-lora8 "${nano[@]}" "${lora8[@]}"
bench nano-lora64 "${nano[@]}" "${lora64[@]}"
bench nano-batch-invariant "${nano[@]}" --batch-invariant
bench batch1-plain "${single[@]}"
bench batch1-lora8 "${single[@]}" "${lora8[@]}"
rm -rf "$OUT/adapters"  # written for the runs; not worth bringing back
# The device call brings back at most 8 files: the JSON reports, and the logs in one archive.
(cd "$OUT" && ls ./*.log > /dev/null 2>&1 && tar czf logs.tgz ./*.log && rm -f ./*.log)
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def rate(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text())["results"]["shoal"]["output_tokens_per_s"] if path.exists() else None
print("summary")
for base, other in [("nano-plain", "nano-lora8"), ("nano-plain", "nano-lora64"),
                    ("nano-plain", "nano-batch-invariant"), ("batch1-plain", "batch1-lora8")]:
    a, b = rate(base), rate(other)
    print(f"{other} / {base}: {b / a:.3f} ({b:.1f} / {a:.1f} output tok/s)" if a and b else f"{other}: missing")
PY
