#!/usr/bin/env bash
# RL weight updates on one GPU, in one call: the GPU tests (CUDA IPC from this process into an
# engine-core process, the in-process path, a folder; the NCCL test needs two GPUs and skips on
# one), then the CUDA-IPC update of an 8B-shaped bf16 model (tests/gpu/rl_ipc_bench.py).
# Into $OUT: pytest-rl.log and rl_ipc.json; the JSON is printed.
#   run(command="bash tests/gpu/run_rl_weights.sh", carry=[".whl"])
# Extra arguments go to rl_ipc_bench.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
source .whl/prelude.sh || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/shoal-rl-out}
mkdir -p "$OUT"
status=0
python3 -m pytest -v -m gpu -p no:cacheprovider -rfEs tests/gpu/test_weight_update_gpu.py > "$OUT/pytest-rl.log" 2>&1 || status=1
grep -E "(PASSED|FAILED|ERROR|SKIPPED)|^=+ .*(passed|failed|error)" "$OUT/pytest-rl.log" | tail -8
python3 tests/gpu/rl_ipc_bench.py --output "$OUT/rl_ipc.json" "$@" || status=1
echo "run_rl_weights status=$status"
exit $status
