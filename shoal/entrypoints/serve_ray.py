"""Replicated serving on Ray Serve: shoal's OpenAI app (`api_server.build_app`) in every replica
of a Serve deployment, each replica one engine.

Each replica gets a placement group from Serve: a small bundle for the replica itself, then one
bundle per TP x PP worker, which the engine's workers take (`ray_utils.reserve_placement_group`
uses the current group). Serve routes requests over the replicas and, when a replica's health
check fails (its engine is dead), replaces it: the group goes with the old replica and the new
one loads the model into a new group. `/health` and `/metrics` answer for the replica that gets
the request; every metric carries a `replica` label.

    shoal serve MODEL --num-replicas 2 [engine arguments]            # from the shoal command
    serve run shoal.serve_ray:build_app model=MODEL num_replicas=2   # Ray Serve's command
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from ray import serve

from shoal.entrypoints.openai.api_server import ServerArgs
from shoal.entrypoints.openai.api_server import build_app as build_openai_app

if TYPE_CHECKING:
    from fastapi import FastAPI
    from ray.serve import Application

    from shoal.config import EngineArgs

logger = logging.getLogger(__name__)

# Serve pings each replica this often; a dead engine is replaced within about period + timeout.
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 20.0
# The bundle of the replica itself (the API and the engine core; the workers hold the devices).
# On CPU it is below one CPU, so that no worker mistakes it for one of its bundles.
REPLICA_BUNDLE = {"cuda": {"CPU": 1.0}, "cpu": {"CPU": 0.1}}


@serve.ingress()
class ShoalReplica:
    """One engine and the OpenAI app around it."""

    async def __init__(self, engine_args: EngineArgs, server_args: ServerArgs) -> None:
        from shoal.frontend.async_llm import AsyncLLM

        self.replica = serve.get_replica_context().replica_id.unique_id
        # The core runs in this replica; its workers go into the replica's placement group.
        engine_args = dataclasses.replace(engine_args, distributed_executor_backend="ray")
        self.engine = AsyncLLM(engine_args, multiprocess=False)
        self.server_args = server_args
        logger.info("replica %s serves %s", self.replica, self.engine.config.model_config.served_model_name)

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = build_openai_app(self.engine, self.server_args, shutdown_engine=True)
        metrics = app.state.shoal.metrics
        render = metrics.render
        metrics.render = lambda: label_samples(render(), "replica", self.replica)
        return app

    async def check_health(self) -> None:
        """Serve's health check: fails once the engine is dead, so that Serve replaces us."""
        if self.engine.errored:
            raise RuntimeError(f"replica {self.replica}: the engine is dead")
        await asyncio.wait_for(self.engine.check_health(), HEALTH_CHECK_TIMEOUT_S / 2)


def label_samples(exposition: bytes, name: str, value: str) -> bytes:
    """Prometheus text with `name="value"` added to every sample's labels."""
    label = f'{name}="{value}"'
    lines = []
    for line in exposition.decode().splitlines():
        if line and not line.startswith("#"):
            metric, sep, rest = line.partition("{")
            if sep:
                line = f"{metric}{{{label},{rest}"
            else:
                metric, _, sample = line.partition(" ")
                line = f"{metric}{{{label}}} {sample}"
        lines.append(line)
    return ("\n".join(lines) + "\n").encode()


def deployment(
    engine_args: EngineArgs, server_args: ServerArgs | None = None, num_replicas: int = 1, device: str | None = None
) -> Application:
    """The Serve application: `num_replicas` replicas of `ShoalReplica`, each in a placement
    group of its own bundle plus one per worker (`device`: where the workers run; none: GPUs
    when the cluster has any)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    device = device or _cluster_device(engine_args.device)
    replica_bundle = REPLICA_BUNDLE[device]
    worker_bundle = {"GPU": 1.0} if device == "cuda" else {"CPU": 1.0}
    num_workers = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    return serve.deployment(
        ShoalReplica,
        name="shoal",
        num_replicas=num_replicas,
        ray_actor_options={"num_cpus": replica_bundle["CPU"]},
        placement_group_bundles=[replica_bundle] + [worker_bundle] * num_workers,
        placement_group_strategy=engine_args.placement_strategy,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        max_ongoing_requests=4 * engine_args.max_num_seqs,
    ).bind(engine_args, server_args or ServerArgs())


def _cluster_device(device: str) -> str:
    if device in ("cpu", "cuda"):
        return device
    import ray

    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def build_app(args: dict[str, Any]) -> Application:
    """The builder `serve run shoal.serve_ray:build_app key=value ...` calls: each key is a
    `shoal serve` flag (`model`, `tensor_parallel_size` or `tensor-parallel-size`, ...), plus
    `num_replicas`. A flag without a value (`enforce_eager=true`) is a boolean."""
    from shoal.cli import engine_args_from, make_parser, server_args_from

    args = dict(args)
    num_replicas = int(args.pop("num_replicas", args.pop("num-replicas", 1)))
    argv = ["serve"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            argv.append(flag if str(value).lower() == "true" else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    parser = make_parser()
    parsed = parser.parse_args(argv)
    return deployment(engine_args_from(parsed), server_args_from(parsed, parser), num_replicas)


def run_replicated(engine_args: EngineArgs, server_args: ServerArgs, num_replicas: int) -> None:
    """`shoal serve --num-replicas N`: Serve's HTTP proxy on `server_args.host:port`, N replicas
    behind it, until interrupted (then the application is deleted)."""
    import time

    from shoal.executors.ray_utils import connect_to_ray

    connect_to_ray(engine_args.ray_address, None)
    serve.start(http_options={"host": server_args.host, "port": server_args.port})
    serve.run(deployment(engine_args, server_args, num_replicas), name="shoal", route_prefix="/")
    logger.info(
        "shoal is serving with %d replicas at http://%s:%d/v1", num_replicas, server_args.host, server_args.port
    )
    try:
        while True:
            time.sleep(1.0)
    finally:
        serve.delete("shoal")
