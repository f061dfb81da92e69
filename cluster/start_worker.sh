#!/usr/bin/env bash
# Join this machine to a shoal Ray cluster as a worker node.
#
#   cluster/start_worker.sh <head IP>:<port> [more `ray start` flags, e.g. --num-gpus=8 --block]
#
#   NODE_IP   this node's address on the network the head reaches it by (default: Ray's guess)
#   RAY       the `ray` command (default: the one on PATH)
#
# Every node needs the same Python environment as the driver (shoal installed, same versions)
# and the model files at the same path (or HF_HOME pointing at a shared cache).
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 <head IP>:<port> [ray start flags...]" >&2
    exit 2
fi
head_address="$1"
shift
args=(--address="$head_address" --disable-usage-stats)
if [[ -n "${NODE_IP:-}" ]]; then
    args+=(--node-ip-address="$NODE_IP")
fi
exec "${RAY:-ray}" start "${args[@]}" "$@"
