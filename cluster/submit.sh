#!/usr/bin/env bash
# Submit `shoal batch` or `shoal serve` to a running Ray cluster as a Ray job (Ray's job API,
# served by the head node's dashboard: start the head without --include-dashboard=false).
#
#   cluster/submit.sh <head IP> batch -i requests.jsonl -o results.jsonl --model /models/M -tp 2
#   cluster/submit.sh <head IP> serve /models/M -tp 8 -pp 2 --host 0.0.0.0 --port 8000
#
#   RAY_DASHBOARD_PORT  the head's dashboard port (default 8265)
#   WORKING_DIR         upload this folder as the job's working_dir (e.g. a shoal checkout that
#                       the nodes do not have installed); default: none, shoal is installed
#   ENV_VARS            more runtime_env variables, as JSON members: '"HF_HOME": "/shared/hf"'
#   PYTHON              the Python that runs shoal on the head (default: python)
#   SUBMIT_FLAGS        more `ray job submit` flags (--no-wait, --submission-id ID, ...)
#   RAY                 the `ray` command (default: the one on PATH)
#
# The job's entrypoint runs on the head node; shoal's workers go wherever the placement group
# puts them. Variables of this shell do not reach the cluster: the runtime_env carries the
# ones named here and the interface variables below if they are set (env vars given to
# `ray start` reach every process on that node, too). Paths (-i, -o, the model) are the
# nodes' paths, not this machine's.
set -euo pipefail

if [[ $# -lt 2 || ( "$2" != batch && "$2" != serve ) ]]; then
    echo "usage: $0 <head IP> {batch|serve} [shoal flags...]" >&2
    exit 2
fi
head_ip="$1"
command="$2"
shift 2

env_vars="\"SHOAL_LOGGING_LEVEL\": \"${SHOAL_LOGGING_LEVEL:-INFO}\""
for name in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_HCA HF_HOME; do
    if [[ -n "${!name:-}" ]]; then
        env_vars+=", \"$name\": \"${!name}\""
    fi
done
if [[ -n "${ENV_VARS:-}" ]]; then
    env_vars+=", ${ENV_VARS}"
fi
runtime_env="{\"env_vars\": {${env_vars}}"
if [[ -n "${WORKING_DIR:-}" ]]; then
    runtime_env+=", \"working_dir\": \"${WORKING_DIR}\""
fi
runtime_env+="}"

# shellcheck disable=SC2086  # SUBMIT_FLAGS is a list of flags
exec "${RAY:-ray}" job submit \
    --address "http://${head_ip}:${RAY_DASHBOARD_PORT:-8265}" \
    --runtime-env-json "$runtime_env" \
    ${SUBMIT_FLAGS:-} \
    -- "${PYTHON:-python}" -m shoal "$command" "$@"
