#!/usr/bin/env bash
# Everything the DeepSeek work needs on one H200, in one call:
#   build  the CUDA ops (rotary, rms_norm, moe_align_block_size, ...)          build.log
#   test   the gpu-marked DeepSeek tests: the Triton MLA decode (split-K) and   pytest-deepseek.log, junit-deepseek.xml
#          latent cache write against their references over shapes and dtypes,
#          tiny DeepSeek-V2/V3 against transformers in float32 (CUDA graphs),
#          a bf16 random DeepSeek-V2 against float32
#   bench  DeepSeek-V2-Lite bf16 and the 8-layer DeepSeek-V3 in block fp8,       bench/*.json, bench.log
#          dummy weights, the nano-vllm protocol (tests/gpu/deepseek_bench.py)
# and prints a summary table last. Results go to $OUT.
#   bash tests/gpu/run_deepseek.sh            (sources .whl/prelude.sh itself when it is there)
# SHOAL_DEEPSEEK_STEPS picks steps (default "build test bench"; also "tune": the fused-MoE table of
# DeepSeek-V2-Lite, back as fused_moe_configs.tgz, and "kernels": benchmarks/bench_mla_decode.py);
# SHOAL_DEEPSEEK_MODELS the bench's models (default "deepseek_v2_lite deepseek_v3_8layer").
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -f .whl/prelude.sh ]; then source .whl/prelude.sh || exit 1; fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/shoal-deepseek-out}
STEPS=${SHOAL_DEEPSEEK_STEPS:-build test bench}
MODELS=${SHOAL_DEEPSEEK_MODELS:-deepseek_v2_lite deepseek_v3_8layer}
PYTHON=${PYTHON:-python3}
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
  step build build.log "$PYTHON" -m shoal.kernels.build --build-dir "${SHOAL_BUILD_DIR:-/tmp/shoal-build}"
fi
if [[ " $STEPS " == *" test "* ]]; then
  step test pytest-deepseek.log "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider -ra --durations=10 \
    --junitxml="$OUT/junit-deepseek.xml" tests/kernels/test_mla_decode.py tests/gpu/test_gpu_deepseek.py
fi
if [[ " $STEPS " == *" tune "* ]]; then
  # DeepSeek-V2-Lite's experts (64 of 1,408): no tuned table yet. The tables come back in a
  # tarball (the device tool returns no file name with "=" or ",").
  step tune tune.log "$PYTHON" benchmarks/tune_fused_moe.py --model benchmarks/configs/deepseek-v2-lite --update \
    --token-counts 256 128 192 64 --max-seconds "${SHOAL_TUNE_SECONDS:-200}" --summary "$OUT/tune_summary.json"
  tar czf "$OUT/fused_moe_configs.tgz" -C shoal/kernels/triton fused_moe_configs
fi
if [[ " $STEPS " == *" kernels "* ]]; then
  step kernels kernels.log "$PYTHON" benchmarks/bench_mla_decode.py --output "$OUT/bench_mla_decode.json"
fi
if [[ " $STEPS " == *" bench "* ]]; then
  # shellcheck disable=SC2086  # MODELS is a list of names
  step bench bench.log timeout -s INT -k 30 "${SHOAL_BENCH_TIMEOUT_S:-420}" "$PYTHON" tests/gpu/deepseek_bench.py \
    --out "$OUT/bench" --only $MODELS
fi

echo
echo "=== summary"
printf '%s\n' "${summary[@]}"
grep -A 20 "^summary (" "$OUT/bench.log" 2>/dev/null || true
exit $status
