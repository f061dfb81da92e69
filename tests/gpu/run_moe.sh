#!/usr/bin/env bash
# Everything the mixture-of-experts work needs on one H200, in one call (about 9 minutes):
#   build  the CUDA ops (moe_align_block_size, silu_and_mul, ...)             build.log, shoal_C.tgz
#   tune   the fused-MoE launch table of Qwen3-30B-A3B (bf16, one GPU)         tune.log, the table, tune_summary.json
#   test   the gpu-marked MoE tests: kernels against their references          pytest-moe.log, junit-moe.xml
#          (and a failing check in a CUDA op raising, not crashing),
#          tiny MoE models against transformers, bf16 against float32,
#          nothing compiled after start-up
#   bench  Qwen3-30B-A3B, dummy weights: engine start, the nano-vllm protocol,  bench/*.json, bench.log
#          `shoal serve` ready time and a 256-request load (tests/gpu/moe_bench.py)
# and prints a summary table last. Results go to $OUT. The tuned table lands in
# shoal/kernels/triton/fused_moe_configs/ (the later steps use it) and comes back in
# $OUT/fused_moe_configs.tgz to be committed.
#   bash tests/gpu/run_moe.sh            (sources .whl/prelude.sh itself when it is there)
# SHOAL_MOE_STEPS picks steps (default "build tune test bench"); SHOAL_TUNE_SECONDS caps the
# tuner's search (default 200: batch sizes not reached keep the heuristic's launch);
# SHOAL_MOE_MODEL the model the tuner tunes (default benchmarks/configs/qwen3-30b-a3b). The
# tables come back as $OUT/fused_moe_configs.tgz (untar into shoal/kernels/triton/).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -f .whl/prelude.sh ]; then source .whl/prelude.sh || exit 1; fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/shoal-moe-out}
STEPS=${SHOAL_MOE_STEPS:-build tune test bench}
PYTHON=${PYTHON:-python3}
MODEL=${SHOAL_MOE_MODEL:-benchmarks/configs/qwen3-30b-a3b}
mkdir -p "$OUT"
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
status=0
summary=()

step() {  # step NAME LOG COMMAND...: run, tee to $OUT/LOG, record the outcome
  local name=$1 log=$2 start=$SECONDS
  shift 2
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$OUT/$log"
  local rc=${PIPESTATUS[0]}
  summary+=("$(printf '%-6s %-5s %4ds  %s' "$name" "$([ "$rc" -eq 0 ] && echo ok || echo FAIL)" $((SECONDS - start)) "$OUT/$log")")
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))" \
  | tee "$OUT/versions.txt"

if [[ " $STEPS " == *" build "* ]]; then
  # The built library comes back in a tarball, to be carried by later calls (no rebuild).
  step build build.log "$PYTHON" -m shoal.kernels.build --build-dir "${SHOAL_BUILD_DIR:-/tmp/shoal-build}" \
    && tar czf "$OUT/shoal_C.tgz" shoal/_C.so shoal/_C.so.json
fi
if [[ " $STEPS " == *" tune "* ]]; then
  if step tune tune.log "$PYTHON" benchmarks/tune_fused_moe.py --model "$MODEL" \
      --max-seconds "${SHOAL_TUNE_SECONDS:-200}" --summary "$OUT/tune_summary.json"; then
    # The device tool brings back no file whose name holds "=" or ",": the tables travel in a tarball.
    tar czf "$OUT/fused_moe_configs.tgz" -C shoal/kernels/triton fused_moe_configs
  fi
fi
if [[ " $STEPS " == *" test "* ]]; then
  step test pytest-moe.log "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider -ra --durations=10 \
    --junitxml="$OUT/junit-moe.xml" tests/kernels/test_csrc_loader.py tests/kernels/test_fused_moe.py \
    tests/kernels/test_moe_align_block_size.py tests/gpu/test_gpu_moe.py
fi
if [[ " $STEPS " == *" bench "* ]]; then
  step bench bench.log timeout -s INT -k 30 "${SHOAL_BENCH_TIMEOUT_S:-330}" "$PYTHON" tests/gpu/moe_bench.py --out "$OUT/bench"
fi

echo
echo "=== summary"
printf '%s\n' "${summary[@]}"
grep -A 20 "^summary (" "$OUT/bench.log" 2>/dev/null || true
exit $status
