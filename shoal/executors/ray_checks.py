"""The cluster failures users meet most, each turned into a message that says what to do, within
seconds rather than after a hang:

- a cluster address whose control store (GCS) is gone (`check_gcs_reachable`, `stale_local_address`);
- a worker node whose Python, torch or shoal differs from the driver's, a model folder missing
  on a node, a GPU the worker actor cannot see (`environment_problems`, run in each worker);
- a torch.distributed group whose set-up fails or does not finish (`distributed_setup_message`);
- a placement group that no node set of the cluster can hold (`infeasible_placement_message`).
"""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass

# How long a TCP connect to a GCS may take before its address counts as dead.
GCS_PROBE_TIMEOUT_S = 2.0
# The variables that choose the network interface of the process groups.
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NODE_IP")


@dataclass(frozen=True)
class Versions:
    python: str
    torch: str
    shoal: str

    def differences(self, other: Versions) -> list[str]:
        """'torch 2.13.0 (the driver has 2.11.0)', one per package that differs."""
        return [
            f"{name} {getattr(self, name)} (the driver has {getattr(other, name)})"
            for name in ("python", "torch", "shoal")
            if getattr(self, name) != getattr(other, name)
        ]


def local_versions() -> Versions:
    import torch

    import shoal

    return Versions(python=platform.python_version(), torch=str(torch.__version__), shoal=shoal.__version__)


def environment_problems(driver: Versions, model_path: str, device: str) -> list[str]:
    """What is wrong with this worker's node for the engine (empty: nothing)."""
    problems = []
    differences = local_versions().differences(driver)
    if differences:
        problems.append(
            f"{', '.join(differences)}: install the same Python packages on every node "
            "(one container image, or the same `pip install` everywhere)"
        )
    if not os.path.isdir(model_path):
        problems.append(
            f"the model folder {model_path!r} is missing on this node (working directory {os.getcwd()!r}): "
            "copy it to the same absolute path on every node, or put it on a shared disk (HF_HOME)"
        )
    if device == "cuda":
        problems += _gpu_problems()
    return problems


def _gpu_problems() -> list[str]:
    import ray
    import torch

    assigned = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    if torch.cuda.is_available() and assigned:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [
        f"no usable GPU in the worker actor (Ray assigned {assigned or 'none'}, CUDA_VISIBLE_DEVICES={visible!r}, "
        f"torch sees {torch.cuda.device_count()}): start the node with `ray start --num-gpus=N`, do not set "
        "CUDA_VISIBLE_DEVICES for Ray's processes, and check the driver (nvidia-smi) on that node"
    ]


def node_problems_message(problems_by_worker: list[tuple[int, str, list[str]]]) -> str:
    """One message for every worker's problems: (rank, node IP, problems)."""
    lines = [f"worker rank {rank} on node {ip}: {'; '.join(problems)}" for rank, ip, problems in problems_by_worker]
    return "The engine's workers cannot run where Ray placed them:\n  " + "\n  ".join(lines)


def distributed_setup_message(init_method: str, timeout_s: float | None, error: BaseException | None) -> str:
    """Why the process group did not form, and the variables that pick its network."""
    what = f"failed: {error}" if error is not None else f"did not finish within {timeout_s:g} s"
    current = ", ".join(f"{name}={os.environ.get(name)!r}" for name in INTERFACE_VARIABLES)
    return (
        f"The workers' torch.distributed group (rendezvous {init_method}) {what}. Every worker must reach "
        "rank 0's address: set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the interface of the nodes' "
        "shared network (and NODE_IP for cluster/start_*.sh) on every node, check that no firewall blocks "
        f"the ports between nodes, and rerun with NCCL_DEBUG=INFO for NCCL. Here: {current}."
    )


# ---- the cluster address ----------------------------------------------------------------------


def gcs_answers(address: str, timeout_s: float = GCS_PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections at `address` (host:port of a GCS)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def check_gcs_reachable(address: str, source: str) -> None:
    """Raise `ConnectionError` at once if no GCS answers at a host:port `address` (Ray itself
    would retry for minutes). `source` says where the address came from, for the message."""
    if "://" in address or address in ("auto", "local"):
        return  # a Ray Client address or a keyword: Ray's own handling
    if not gcs_answers(address):
        raise ConnectionError(
            f"No Ray cluster answers at {address} ({source}): its head node is down or the address is stale. "
            f"Start the head (cluster/start_head.sh) or fix the address (`ray status --address {address}`); "
            "leave RAY_ADDRESS and ray_address unset to start a local Ray cluster instead."
        )


def stale_local_address() -> str | None:
    """The address the latest `ray start` on this node left behind, if its GCS is gone (a node
    that died without `ray stop`): `ray.init(address="auto")` would retry it for minutes."""
    from ray._private.utils import read_ray_address  # where `ray start` records it

    address = read_ray_address()
    if address and not gcs_answers(address):
        return address
    return None


@dataclass(frozen=True)
class NodeResources:
    address: str
    total: dict[str, float]
    free: dict[str, float]


def infeasible_placement_message(
    bundle: dict[str, float], num_bundles: int, strategy: str, nodes: list[NodeResources]
) -> str | None:
    """Why `num_bundles` bundles of `bundle` can never be placed with `strategy` on these nodes,
    even were they idle (None: they can be). Ray would wait for such a group forever."""
    fits = [min(int(node.total.get(name, 0.0) // amount) for name, amount in bundle.items()) for node in nodes]
    if strategy == "STRICT_PACK":
        feasible, rule = max(fits, default=0) >= num_bundles, f"one node that holds all {num_bundles}"
    elif strategy == "STRICT_SPREAD":
        feasible, rule = sum(f >= 1 for f in fits) >= num_bundles, f"{num_bundles} nodes that hold one each"
    else:
        feasible, rule = sum(fits) >= num_bundles, f"room for {num_bundles} over all nodes"
    if feasible:
        return None
    lines = [
        f"  {node.address}: "
        + ", ".join(f"{name} {node.total.get(name, 0.0):g} ({node.free.get(name, 0.0):g} free)" for name in bundle)
        + f": {fit} bundle(s)"
        for node, fit in zip(nodes, fits)
    ]
    return (
        f"The cluster can never place {num_bundles} worker bundles {bundle} with placement strategy {strategy} "
        f"(it needs {rule}); its nodes:\n" + "\n".join(lines) + "\n"
        "Add nodes with these resources (cluster/start_worker.sh), choose another --placement-strategy, "
        "or lower tensor_parallel_size x pipeline_parallel_size."
    )
