#!/usr/bin/env bash
# Compile every translation unit in csrc/ with nvcc for sm_90a, without linking: the check a
# machine with no GPU (and a CPU-only torch) can do. The GPU build (shoal/kernels/build.py)
# links and loads the library; this only proves each file compiles.
#
#   bash csrc/compile_check.sh [file ...]       (default: every csrc/*.cu and csrc/*.cpp)
#
# Environment: PYTHON (default .venv/bin/python, else python3), CUTLASS_INCLUDE_DIR (default:
# the nvidia-cutlass package if importable, else /tmp/cutlass/cutlass_library/source/include,
# where `unzip .whl/nvidia_cutlass-*.whl -d /tmp/cutlass` puts it), NVCC (default nvcc), JOBS.
#
# CPU builds of torch ship the CUDA headers of c10 but not the one CMake generates
# (c10/cuda/impl/cuda_cmake_macros.h); -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE skips it here only.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
NVCC=${NVCC:-nvcc}
JOBS=${JOBS:-$(nproc)}
OUT_DIR=${OUT_DIR:-/tmp/shoal-compile-check}
mkdir -p "$OUT_DIR"

TORCH_INCLUDES=$("$PYTHON" -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")
if [ -z "${CUTLASS_INCLUDE_DIR:-}" ]; then
  CUTLASS_INCLUDE_DIR=$("$PYTHON" -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))" 2>/dev/null || echo /tmp/cutlass/cutlass_library/source/include)
fi
[ -f "$CUTLASS_INCLUDE_DIR/cutlass/cutlass.h" ] || { echo "CUTLASS headers not found at $CUTLASS_INCLUDE_DIR"; exit 1; }

FLAGS=(-std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr --expt-extended-lambda
       -Xcompiler=-fPIC -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE -DNDEBUG $TORCH_INCLUDES -I"$CUTLASS_INCLUDE_DIR" -Icsrc)

FILES=("$@")
[ ${#FILES[@]} -gt 0 ] || FILES=(csrc/*.cu csrc/*.cpp)

compile() {
  local src=$1 obj="$OUT_DIR/$(basename "$1").o" log="$OUT_DIR/$(basename "$1").log" start=$SECONDS
  if "$NVCC" "${FLAGS[@]}" -Xptxas=-v -c "$src" -o "$obj" >"$log" 2>&1; then
    echo "ok    $src ($((SECONDS - start)) s)"
  else
    echo "FAIL  $src (log: $log)"; grep -m 20 -E "error|Error" "$log" || tail -20 "$log"; return 1
  fi
}

status=0
pids=()
for f in "${FILES[@]}"; do
  compile "$f" & pids+=($!)
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 0.2; done
done
for p in "${pids[@]}"; do wait "$p" || status=1; done
[ $status -eq 0 ] && echo "all ${#FILES[@]} translation units compiled for sm_90a" || echo "some translation units FAILED"
exit $status
