"""Ray plumbing for `RayExecutor`: joining (or starting) a cluster, reserving one placement-group
bundle per worker, ordering the bundles driver-node first, and the worker actor itself.

shoal imports Ray only in `shoal/executors/` and `cluster/`.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group_table

from shoal import envs
from shoal.config import EngineConfig, ParallelConfig
from shoal.distributed.communicator import NcclUniqueId, nccl_unique_id
from shoal.executors import ray_checks
from shoal.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# The worker actors' control methods (health pings) run on a thread of their own, so that a
# ping is answered while a step is running.
HEALTH_CONCURRENCY_GROUP = "health"


# ---- the cluster -----------------------------------------------------------------------------------


def connect_to_ray(address: str | None, num_cpus: int | None) -> None:
    """Join a running Ray cluster: `address` when given, else RAY_ADDRESS, else one running on
    this node (the latest `ray start`). With none running, start a local one with `num_cpus`
    logical CPUs. Nothing happens when this process is already connected (a user's driver, or
    shoal running inside a Ray actor)."""
    if ray.is_initialized():
        return
    with _sigterm_handler_kept():
        _join_or_start_ray(address, num_cpus)


@contextlib.contextmanager
def _sigterm_handler_kept() -> Iterator[None]:
    """Keep this process's SIGTERM handler across `ray.init`, which replaces it: in Python with
    Ray's own and, beneath it, with a C++ handler that prints a stack dump (`*** SIGTERM received
    at time=... PC: @ ...`) on every SIGTERM, including the one with which the frontend asks an
    engine-core process to shut down cleanly. Setting the handler again from Python puts back
    the process's own and removes the dump."""
    if threading.current_thread() is not threading.main_thread():  # only it may set handlers
        yield
        return
    own = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if own is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGTERM, own)


def _join_or_start_ray(address: str | None, num_cpus: int | None) -> None:
    quiet: dict[str, Any] = dict(logging_level=logging.WARNING, log_to_driver=True)
    # RAY_ADDRESS is Ray's own variable: an address given there must be reached, not replaced.
    source = "ray_address" if address else "RAY_ADDRESS"
    address = address or envs.RAY_ADDRESS
    if address:
        ray_checks.check_gcs_reachable(address, source)  # Ray would retry a dead one for minutes
        ray.init(address=address, **quiet)
        logger.info("Joined the Ray cluster at %s", ray.get_runtime_context().gcs_address)
        return
    stale = ray_checks.stale_local_address()
    if stale is not None:
        logger.warning(
            "The Ray cluster last started on this node (%s) is gone (a node that died without `ray stop`); "
            "starting a local one. Run `ray stop` to forget it, or set RAY_ADDRESS to the cluster's head.",
            stale,
        )
    else:
        try:
            ray.init(address="auto", **quiet)
        except ConnectionError:  # no cluster on this node
            stale = "none"
    if stale is not None:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **quiet)
        logger.info("Started a local Ray cluster (%s CPUs)", num_cpus or "all")
        return
    logger.info("Joined the Ray cluster at %s", ray.get_runtime_context().gcs_address)


def worker_bundle(device: str, parallel: ParallelConfig | None = None) -> dict[str, float]:
    """The resources of one worker: its share of a GPU (`num_gpus_per_worker`, 1 unless a
    colocated trainer shares the GPU), or on CPU its logical CPUs (`num_cpus_per_worker`)."""
    parallel = parallel or ParallelConfig()
    return {"GPU": parallel.num_gpus_per_worker} if device == "cuda" else {"CPU": parallel.num_cpus_per_worker}


# ---- the placement group ----------------------------------------------------------------------------


def reserve_placement_group(
    num_workers: int, device: str, timeout_s: float, parallel: ParallelConfig | None = None
) -> tuple[PlacementGroup, list[int], bool]:
    """(placement group, the bundle index of each rank, whether shoal created the group).

    The group is the caller's when one is given (`parallel.placement_group`, or its name), else
    the current one when shoal runs inside a placement group (from a user's actor or task);
    there the workers take `parallel.bundle_indices` in rank order when given, else the bundles
    that hold a worker's resources. Otherwise a new group of `num_workers` bundles is created
    and waited for. Ranks get bundles on the driver's node first, then node by node (unless the
    caller chose them), so that a tensor-parallel group shares a node whenever it can; a new
    group uses Ray's `parallel.placement_strategy` (PACK by default). A group shoal did not
    create is never removed by it.
    """
    bundle = worker_bundle(device, parallel)
    given = resolve_placement_group(parallel.placement_group) if parallel is not None else None
    bundle_indices = parallel.bundle_indices if parallel is not None else None
    current = given or get_current_placement_group()
    if current is not None:
        usable = usable_bundles(current, bundle, num_workers, bundle_indices)
        wait_for_placement_group(current, [bundle] * num_workers, timeout_s)
        ranks = list(bundle_indices) if bundle_indices is not None else driver_node_first(current, usable)[:num_workers]
        return current, ranks, False
    if bundle_indices is not None:
        raise ValueError("bundle_indices needs a placement group: pass placement_group, or start shoal inside one")
    bundles = [dict(bundle) for _ in range(num_workers)]
    strategy = parallel.placement_strategy if parallel is not None else "PACK"
    problem = ray_checks.infeasible_placement_message(bundle, num_workers, strategy, cluster_nodes())
    if problem is not None:
        raise RuntimeError(problem)
    group = ray.util.placement_group(bundles, strategy=strategy, name=f"shoal-{uuid.uuid4().hex[:12]}")
    try:
        wait_for_placement_group(group, bundles, timeout_s)
    except BaseException:
        ray.util.remove_placement_group(group)
        raise
    return group, driver_node_first(group, list(range(num_workers))), True


def cluster_nodes() -> list[ray_checks.NodeResources]:
    """The alive nodes, each with its resources and what is free of them."""
    try:
        from ray._private.state import available_resources_per_node  # no public per-node view

        free = available_resources_per_node()
    except (ImportError, AttributeError):
        free = {}
    return [
        ray_checks.NodeResources(
            address=f"node {node['NodeID'][:8]} at {node['NodeManagerAddress']}"
            + (" (head)" if "node:__internal_head__" in node["Resources"] else ""),
            total=node["Resources"],
            free=free.get(node["NodeID"], {}),
        )
        for node in ray.nodes()
        if node["Alive"]
    ]


def resolve_placement_group(group: Any) -> PlacementGroup | None:
    """A `PlacementGroup` as given, or the one named so (a ValueError if there is none)."""
    if not isinstance(group, str):
        return group
    try:
        return ray.util.get_placement_group(group)
    except ValueError:
        raise ValueError(f"there is no placement group named {group!r} in the Ray cluster") from None


def usable_bundles(
    group: PlacementGroup, bundle: dict[str, float], num_workers: int, bundle_indices: tuple[int, ...] | None
) -> list[int]:
    """The bundles of `group` a worker may take: those named, each checked to exist and to hold
    a worker's resources; else every bundle that holds them (at least `num_workers`)."""
    resource, amount = next(iter(bundle.items()))
    specs = group.bundle_specs
    if bundle_indices is not None:
        for index in bundle_indices:
            if index >= len(specs):
                raise ValueError(f"bundle index {index} is out of range: the placement group has {len(specs)} bundles")
            if specs[index].get(resource, 0) < amount:
                raise ValueError(f"bundle {index} of the placement group ({specs[index]}) lacks a worker's {bundle}")
        return list(bundle_indices)
    usable = [i for i, spec in enumerate(specs) if spec.get(resource, 0) >= amount]
    if len(usable) < num_workers:
        raise ValueError(
            f"the placement group has {len(usable)} bundles with {bundle}, {num_workers} workers need one each"
        )
    return usable


def wait_for_placement_group(group: PlacementGroup, bundles: list[dict[str, float]], timeout_s: float) -> None:
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        raise RuntimeError(missing_resources_message(bundles, timeout_s))


def missing_resources_message(bundles: list[dict[str, float]], timeout_s: float) -> str:
    """Which resources the request needs, against what the cluster has and has free."""
    needed: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            needed[name] = needed.get(name, 0.0) + amount
    total, available = ray.cluster_resources(), ray.available_resources()
    lines = [
        f"{name}: {amount:g} needed, {total.get(name, 0.0):g} in the cluster, {available.get(name, 0.0):g} free"
        for name, amount in sorted(needed.items())
    ]
    return (
        f"Ray could not reserve {len(bundles)} worker bundles {bundles[0]} within {timeout_s:g} s "
        f"({'; '.join(lines)}). Add nodes (cluster/start_worker.sh), free resources other jobs hold "
        "(`ray status`), or lower tensor_parallel_size x pipeline_parallel_size."
    )


def driver_node_first(group: PlacementGroup, bundle_indices: list[int]) -> list[int]:
    """`bundle_indices` of a ready group, in rank order (see `order_bundles`)."""
    bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
    return order_bundles(bundle_indices, bundle_nodes, ray.get_runtime_context().get_node_id())


def order_bundles(bundle_indices: list[int], bundle_nodes: dict[int, str], driver_node: str) -> list[int]:
    """The bundles on the driver's node first, then those of each other node together (so
    that consecutive ranks, a tensor-parallel group, share a node whenever they can)."""
    return sorted(bundle_indices, key=lambda i: (bundle_nodes[i] != driver_node, bundle_nodes[i], i))


def worker_env_vars(device: str) -> dict[str, str]:
    """The environment every worker gets (`envs.forwarded_environment()`); on CPU, one torch
    thread per worker unless SHOAL_CPU_THREADS says otherwise (a worker holds one CPU)."""
    env = envs.forwarded_environment()
    if device == "cpu":
        env.setdefault("SHOAL_CPU_THREADS", "1")
        env.setdefault("OMP_NUM_THREADS", env["SHOAL_CPU_THREADS"])
    return env


# ---- the worker actor ------------------------------------------------------------------------------


@ray.remote(concurrency_groups={HEALTH_CONCURRENCY_GROUP: 1})
class RayWorker:
    """One `shoal.workers.worker.Worker` in a Ray actor, plus what only the actor knows: its
    node, a free port for the process group, NCCL ids. Steps arrive as msgspec bytes (encoded
    once for all workers) and the sampled tokens go back the same way."""

    def __init__(self, config: EngineConfig, rank: int, bundle_index: int | None = None) -> None:
        from shoal.logger import configure_logging
        from shoal.workers.extension import create_worker

        configure_logging()
        self.device = config.device_config.device
        # Without a GPU the worker is not built; `environment_problems` then says why.
        has_gpu = self.device != "cuda" or ray.get_runtime_context().get_accelerator_ids().get("GPU")
        local_rank = local_gpu_index() if self.device == "cuda" and has_gpu else 0
        self.worker = create_worker(config, rank=rank, local_rank=local_rank)
        # Where this worker runs, for `report_device` on CPU (a GPU reports its UUID).
        self.worker.placement = f"{ray.get_runtime_context().get_node_id()}:{bundle_index}"
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self._encoder = msgspec.msgpack.Encoder()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def environment_problems(self, driver_versions: ray_checks.Versions, model_path: str) -> tuple[str, list[str]]:
        """(this node's IP, what keeps the engine from running here: `ray_checks`)."""
        problems = ray_checks.environment_problems(driver_versions, model_path, self.device)
        return ray.util.get_node_ip_address(), problems

    def node_ip_and_free_port(self) -> tuple[str, int]:
        """This node's IP and a port free on it now (for the rank-0 rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def make_nccl_unique_id(self) -> NcclUniqueId:
        """An NCCL unique id for a group this worker is rank 0 of (it hosts the bootstrap)."""
        return nccl_unique_id()

    def execute_method(self, method: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        return self.worker.call(method, args, kwargs)

    def execute_model(self, encoded_scheduler_output: bytes) -> bytes | None:
        output: ModelRunnerOutput | None = self.worker.execute_model(self._decoder.decode(encoded_scheduler_output))
        return None if output is None else self._encoder.encode(output)

    @ray.method(concurrency_group=HEALTH_CONCURRENCY_GROUP)
    def ping(self) -> bool:
        return True

    @ray.method(concurrency_group=HEALTH_CONCURRENCY_GROUP)
    def describe(self) -> dict[str, Any]:
        """Where this worker runs, for `shoal cluster status` (answered even during a step)."""
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "placement_group_id": context.get_placement_group_id(),
            "gpu_ids": [str(i) for i in context.get_accelerator_ids().get("GPU", [])],
        }


def local_gpu_index() -> int:
    """The index, among the GPUs this process sees, of the GPU Ray gave this actor. Ray
    restricts CUDA_VISIBLE_DEVICES to it (index 0) unless told not to, in which case every GPU
    is visible; shoal never changes CUDA_VISIBLE_DEVICES itself."""
    assigned = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    if not assigned:
        raise RuntimeError("this worker actor has no GPU assigned by Ray")
    visible = envs.CUDA_VISIBLE_DEVICES  # set by Ray for this actor process before it started
    if not visible:
        return int(assigned[0])
    return visible.split(",").index(str(assigned[0]))
