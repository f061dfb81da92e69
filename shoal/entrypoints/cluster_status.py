"""`shoal cluster status`: what a Ray cluster holds for shoal. Its nodes (IP, head or not, CPUs
and GPUs in all and free, each GPU's UUID and name), and the shoal engines running on it: each
engine's worker actors (`shoal-worker-<engine id>-<rank>-<incarnation>`, namespace `shoal`) with
their node and placement group, and the placement groups shoal created (`shoal-<hex>`).

It joins the cluster as a driver (`--address`, else RAY_ADDRESS, else the latest `ray start` on
this node) and never starts one.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shoal import envs
from shoal.executors import ray_checks

_WORKER_NAME = re.compile(r"^shoal-worker-(?P<engine>[0-9a-f]+)-(?P<rank>\d+)-(?P<incarnation>\d+)$")
_NVIDIA_SMI = ["nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader"]
# How long one node may take to list its GPUs, and an engine's worker to describe itself.
_CALL_TIMEOUT_S = 10.0


def connect(address: str | None) -> None:
    source = "--address" if address else "RAY_ADDRESS"
    address = address or envs.RAY_ADDRESS
    if address:
        ray_checks.check_gcs_reachable(address, source)
    elif ray_checks.stale_local_address() is not None:
        raise ConnectionError(
            f"The Ray cluster last started on this node ({ray_checks.stale_local_address()}) is gone; "
            "pass --address of a running head node (or `ray stop` to forget it)."
        )
    try:
        ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False)
    except ConnectionError as exc:
        raise ConnectionError(f"No Ray cluster to report on: {exc} (pass --address host:port)") from exc


def cluster_status() -> dict[str, Any]:
    """The nodes and the shoal engines of the cluster this process is connected to."""
    available = ray._private.state.available_resources_per_node()  # Ray's per-node free resources
    nodes = []
    alive = [n for n in ray.nodes() if n["Alive"]]
    gpus = _gpus_by_node([n["NodeID"] for n in alive if n["Resources"].get("GPU", 0) > 0])
    for node in alive:
        node_id, total = node["NodeID"], node["Resources"]
        free = available.get(node_id, {})
        nodes.append(
            {
                "node_id": node_id,
                "ip": node["NodeManagerAddress"],
                "head": "node:__internal_head__" in total,
                "resources": {k: v for k, v in total.items() if _is_plain_resource(k)},
                "free": {k: v for k, v in free.items() if _is_plain_resource(k)},
                "gpus": gpus.get(node_id, []),
            }
        )
    groups = ray.util.placement_group_table()
    return {"gcs_address": ray.get_runtime_context().gcs_address, "nodes": nodes, "engines": _engines(groups)}


def _is_plain_resource(name: str) -> bool:
    """CPU, GPU, memory, custom resources; not Ray's node markers nor placement-group shares."""
    return not name.startswith("node:") and "_group_" not in name and not name.startswith("bundle_group")


def _gpus_by_node(node_ids: list[str]) -> dict[str, list[dict[str, str]]]:
    """Each GPU node's GPUs (index, UUID, name), from a task pinned to that node."""
    refs = {
        node_id: _list_gpus.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        for node_id in node_ids
    }
    result = {}
    for node_id, ref in refs.items():
        ready, _ = ray.wait([ref], timeout=_CALL_TIMEOUT_S)
        result[node_id] = ray.get(ready[0]) if ready else [{"error": "the node did not answer"}]
    return result


@ray.remote(num_cpus=0, num_gpus=0, runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}})
def _list_gpus() -> list[dict[str, str]]:
    try:
        lines = subprocess.run(_NVIDIA_SMI, capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return [{"error": f"nvidia-smi failed: {exc}"}]
    gpus = []
    for line in lines.strip().splitlines():
        index, uuid, name = (part.strip() for part in line.split(",", 2))
        gpus.append({"index": index, "uuid": uuid, "name": name})
    return gpus


def _engines(groups: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The shoal engines: their live worker actors, grouped by engine id, with placement groups."""
    workers: dict[str, list[dict[str, Any]]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        match = _WORKER_NAME.match(actor["name"]) if actor["namespace"] == "shoal" else None
        if match is None:
            continue
        try:
            handle = ray.get_actor(actor["name"], namespace="shoal")
            ready, _ = ray.wait([handle.describe.remote()], timeout=_CALL_TIMEOUT_S)
            info = ray.get(ready[0]) if ready else {"error": "did not answer"}
        except (ValueError, ray.exceptions.RayError) as exc:
            info = {"error": f"{type(exc).__name__}"}  # it ended meanwhile
        info.update(rank=int(match["rank"]), incarnation=int(match["incarnation"]))
        workers.setdefault(match["engine"], []).append(info)
    engines = []
    for engine_id, ranks in sorted(workers.items()):
        group_ids = {w.get("placement_group_id") for w in ranks}
        engines.append(
            {
                "engine_id": engine_id,
                "workers": sorted(ranks, key=lambda w: w["rank"]),
                "placement_groups": [_group_summary(groups[g]) for g in sorted(filter(None, group_ids)) if g in groups],
            }
        )
    owned = {g["placement_group_id"] for e in engines for g in e["placement_groups"]}
    idle = [_group_summary(g) for g in groups.values() if (g.get("name") or "").startswith("shoal-")]
    engines += [{"engine_id": None, "workers": [], "placement_groups": [g]} for g in idle if g["id"] not in owned]
    return engines


def _group_summary(group: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": group["placement_group_id"],
        "placement_group_id": group["placement_group_id"],
        "name": group.get("name") or "",
        "state": group["state"],
        "strategy": group["strategy"],
        "bundles": {str(k): v for k, v in group["bundles"].items()},
        "bundles_to_node_id": {str(k): v for k, v in group.get("bundles_to_node_id", {}).items()},
    }


def format_status(status: dict[str, Any]) -> str:
    """The report as text, one node or engine per paragraph."""
    lines = [f"Ray cluster at {status['gcs_address']}: {len(status['nodes'])} node(s) alive"]
    for node in status["nodes"]:
        role = "head" if node["head"] else "worker"
        amounts = ", ".join(
            f"{name} {node['free'].get(name, 0):g}/{node['resources'][name]:g} free"
            for name in sorted(node["resources"])
            if name not in ("memory", "object_store_memory")
        )
        lines.append(f"  node {node['node_id'][:12]} {node['ip']} ({role}): {amounts}")
        lines += [
            f"    GPU {gpu.get('index', '?')} {gpu.get('uuid', gpu.get('error'))} {gpu.get('name', '')}"
            for gpu in node["gpus"]
        ]
    lines.append(f"shoal engines: {sum(1 for e in status['engines'] if e['engine_id'])}")
    node_ips = {node["node_id"]: node["ip"] for node in status["nodes"]}
    for engine in status["engines"]:
        groups = ", ".join(
            f"{g['name'] or g['id']} ({g['state']}, {g['strategy']})" for g in engine["placement_groups"]
        )
        if engine["engine_id"] is None:
            lines.append(f"  placement group without workers: {groups}")
            continue
        lines.append(
            f"  engine {engine['engine_id']}: {len(engine['workers'])} worker(s), placement group {groups or '-'}"
        )
        for worker in engine["workers"]:
            where = node_ips.get(worker.get("node_id", ""), worker.get("error", "?"))
            gpus = f" GPU {','.join(worker['gpu_ids'])}" if worker.get("gpu_ids") else ""
            lines.append(f"    rank {worker['rank']} on {where}{gpus}")
    return "\n".join(lines)


def main(address: str | None, as_json: bool) -> str:
    connect(address)
    try:
        status = cluster_status()
    finally:
        ray.shutdown()
    return json.dumps(status, indent=2) if as_json else format_status(status)
