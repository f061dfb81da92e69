#!/usr/bin/env bash
# Start the head node of a Ray cluster for shoal, on this machine.
#
#   cluster/start_head.sh [more `ray start` flags, e.g. --num-gpus=8 --block]
#
#   RAY_PORT  the port of the cluster's control store (GCS) that worker nodes and drivers
#             connect to (default 6379)
#   NODE_IP   this node's address on the network the other nodes reach it by (default: Ray's
#             guess; set it on machines with several interfaces)
#   RAY       the `ray` command (default: the one on PATH)
#
# Environment variables present here (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, HF_HOME, ...)
# reach the processes Ray starts on this node; shoal also forwards SHOAL_*, NCCL_*, GLOO_*,
# HF_*, TORCH_* and OMP_* from the driver to every worker. Then, on each other node:
#   cluster/start_worker.sh <this node's IP>:<RAY_PORT>
set -euo pipefail

args=(--head --port="${RAY_PORT:-6379}" --disable-usage-stats)
if [[ -n "${NODE_IP:-}" ]]; then
    args+=(--node-ip-address="$NODE_IP")
fi
exec "${RAY:-ray}" start "${args[@]}" "$@"
