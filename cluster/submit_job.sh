#!/usr/bin/env bash
# Submit cluster/generate_job.py to a running shoal cluster with Ray's job API, served by the
# head node's dashboard (start the head without --include-dashboard=false).
#
#   cluster/submit_job.sh <head IP> --model /models/Llama-3.1-8B-Instruct --tensor-parallel-size 2
#
#   RAY_DASHBOARD_PORT  the head's dashboard port (default 8265)
#   RAY                 the `ray` command (default: the one on PATH)
#
# Variables of this shell do not reach the cluster: the job's runtime_env carries the ones
# named below (add NCCL_SOCKET_IFNAME, HF_HOME, ... as your network and storage need).
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 <head IP> --model <folder> [generate_job.py flags...]" >&2
    exit 2
fi
head_ip="$1"
shift
env_json=$(printf '{"env_vars": {"SHOAL_LOGGING_LEVEL": "%s"}}' "${SHOAL_LOGGING_LEVEL:-INFO}")
exec "${RAY:-ray}" job submit \
    --address "http://${head_ip}:${RAY_DASHBOARD_PORT:-8265}" \
    --working-dir "$(dirname "$0")" \
    --runtime-env-json "$env_json" \
    -- python generate_job.py "$@"
