#!/usr/bin/env bash
# Issue 4's GPU must-show on a machine with 2 GPUs, in one call of about 5 minutes
# (tests/gpu/tp_pp_8b.py): an 8B-shaped random bf16 checkpoint saved once under /tmp/shoal-8b,
# then TP1 (one GPU), TP2 and PP2 (Ray) each give 32 prompts' first 16 greedy tokens and the
# throughput of 256 x (512 in, 128 out); TP2's and PP2's tokens are compared with TP1's.
# Into $OUT: one JSON per layout, the summary JSON and table, and the log (6 files); the summary
# table is printed last.
#   run(kind="nvidia-h200-x2", command="bash tests/gpu/run_tp_pp_8b.sh",
#       carry=[".whl", "shoal/_C.so", "shoal/_C.so.json"])
# SHOAL_TP_PP_TIMEOUT_S (500) caps the script: at the cap it is interrupted, shuts its engine
# down and still writes the summary. Extra arguments go to the script (e.g. --layouts tp1 tp2).
set -uo pipefail
cd "$(dirname "$0")/../.."
source .whl/prelude.sh || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/shoal-tp-pp-out}
mkdir -p "$OUT"
start=$(date +%s)
python3 -c 'import torch; print("torch", torch.__version__, "GPUs:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])' || exit 1
nvidia-smi topo -m 2>/dev/null | head -4
if [ -f shoal/_C.so ]; then echo "shoal/_C.so carried"; else echo "shoal/_C.so not carried: Triton kernels only"; fi
timeout -s INT -k 30 "${SHOAL_TP_PP_TIMEOUT_S:-500}" python3 tests/gpu/tp_pp_8b.py --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/tp_pp_8b.log"
rc=${PIPESTATUS[0]}
ls -l "$OUT"
echo "tp_pp_8b rc=$rc ($(( $(date +%s) - start )) s in all)"
cat "$OUT/tp_pp_8b_summary.txt" 2>/dev/null || echo "no summary written"
exit "$rc"
