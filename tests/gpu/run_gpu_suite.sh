#!/usr/bin/env bash
# One session on the GPU machine for shoal's kernels: build the CUDA ops, run the GPU kernel
# tests, run the kernel benchmarks. Everything worth keeping goes to $OUT: build, test and
# benchmark logs, JUnit XML, bench_kernels.json and the built library with its stamp (carry
# shoal/_C.so and shoal/_C.so.json to a later run to skip the build).
#
#   source .whl/prelude.sh && bash tests/gpu/run_gpu_suite.sh
#
# SHOAL_SUITE_STEPS picks steps (default "build test bench"); SHOAL_BUILD_DIR is the CMake
# build directory (default /tmp/shoal-build, which survives between commands on one machine,
# so an unchanged csrc/ is not rebuilt). Exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-/tmp/shoal-gpu-out}
STEPS=${SHOAL_SUITE_STEPS:-build test bench}
BUILD_DIR=${SHOAL_BUILD_DIR:-/tmp/shoal-build}
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

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
  | tee "$OUT/versions.txt"

if [[ " $STEPS " == *" build "* ]]; then
  if step build build.log "$PYTHON" -m shoal.kernels.build --build-dir "$BUILD_DIR"; then
    cp shoal/_C.so shoal/_C.so.json "$OUT/"
  fi
fi

if [[ " $STEPS " == *" test "* ]]; then
  step test pytest-kernels.log "$PYTHON" -m pytest -q -m gpu tests/kernels -p no:cacheprovider \
    --junitxml="$OUT/junit-kernels.xml" --durations=15 -ra
fi

if [[ " $STEPS " == *" bench "* ]]; then
  step bench bench_kernels.log "$PYTHON" benchmarks/bench_kernels.py --output "$OUT/bench_kernels.json"
fi

echo
echo "=== summary"
printf '%s\n' "${summary[@]}"
exit $status
