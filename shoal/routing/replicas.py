"""`shoal serve --num-replicas N --routing-policy P`: N engine replicas on this host, each a
`shoal serve` process of its own on a free local port publishing its KV-cache events, and the
router (shoal/routing/router.py) in this process on `--host:--port` in front of them.

Each replica gets the command line it was given, less the router's own flags, on 127.0.0.1
with its own event endpoint; on GPUs, its own devices (`CUDA_VISIBLE_DEVICES`: the next
tensor x pipeline parallel GPUs). The replicas end with the router.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shoal.routing.router import ReplicaEndpoint

logger = logging.getLogger(__name__)

# Flags of the router (or set per replica), never passed on to a replica; the value of each.
ROUTER_FLAGS = {
    "--num-replicas": True,
    "--routing-policy": True,
    "--session-header": True,
    "--host": True,
    "--port": True,
    "--kv-events-config": True,
}
READY_TIMEOUT_S = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def replica_argv(argv: Sequence[str]) -> list[str]:
    """`shoal serve`'s arguments less the router's flags (`--flag value` or `--flag=value`)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ROUTER_FLAGS:
            skip = "=" not in arg and ROUTER_FLAGS[name]
            continue
        kept.append(arg)
    return kept


@dataclass
class LocalReplica:
    endpoint: ReplicaEndpoint
    process: subprocess.Popen

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the replica shuts its engine down), then SIGKILL to the whole group."""
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever of the group is left
        self.process.wait()


def start_local_replicas(
    serve_argv: Sequence[str], num_replicas: int, devices_per_replica: Sequence[str] | None = None
) -> list[LocalReplica]:
    """Start the replicas (not waiting for them): `serve_argv` is `shoal serve`'s arguments
    after `serve`, router flags included (they are dropped)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
    replicas = []
    for i in range(num_replicas):
        port = free_port()
        events_endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        events = {"enable_kv_cache_events": True, "endpoint": events_endpoint, "replay_endpoint": replay_endpoint}
        argv = [sys.executable, "-m", "shoal", "serve", *replica_argv(serve_argv)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--kv-events-config", json.dumps(events)]
        env = dict(os.environ)
        if devices_per_replica is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices_per_replica[i]
        # A process group of its own: the replica and its engine-core process end together.
        process = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_end_with_parent)
        endpoint = ReplicaEndpoint(
            url=f"http://127.0.0.1:{port}",
            events_endpoint=events_endpoint,
            replay_endpoint=replay_endpoint,
            name=f"replica-{i}",
            pid=process.pid,
        )
        replicas.append(LocalReplica(endpoint, process))
    return replicas


def _end_with_parent() -> None:
    """In the replica's process before it runs (Linux): SIGTERM when the router dies, even by
    SIGKILL, so that no replica outlives it."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def wait_until_ready(replicas: Sequence[LocalReplica], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait for every replica's /health; `RuntimeError` if one exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        for replica in list(pending):
            if replica.process.poll() is not None:
                raise RuntimeError(f"{replica.endpoint.name} exited with {replica.process.returncode} while starting")
            if _healthy(replica.endpoint.url):
                pending.remove(replica)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"replicas not ready after {timeout_s:g} s: {[r.endpoint.name for r in pending]}")
        time.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def base_model_names(url: str) -> list[str]:
    """The names a replica serves its base model under (its `/v1/models` cards without a parent;
    the others are LoRA adapters)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as answer:
        cards = json.load(answer)["data"]
    return [card["id"] for card in cards if card.get("parent") is None]


def gpu_split(device: str, num_replicas: int, gpus_per_replica: int) -> list[str] | None:
    """Each replica's CUDA_VISIBLE_DEVICES on a GPU host (None on CPU, or when the caller
    already chose the devices)."""
    if device == "cpu" or "CUDA_VISIBLE_DEVICES" in os.environ:
        return None
    import torch

    num_gpus = torch.cuda.device_count()
    if num_gpus == 0:
        return None
    if num_gpus < num_replicas * gpus_per_replica:
        raise ValueError(f"{num_replicas} replicas of {gpus_per_replica} GPU(s) need more than the {num_gpus} here")
    return [",".join(str(i * gpus_per_replica + g) for g in range(gpus_per_replica)) for i in range(num_replicas)]


def run_routed(
    engine_args: Any, server_args: Any, num_replicas: int, policy: str, session_header: str, argv: Sequence[str]
) -> None:
    """Start the replicas and serve the router until interrupted; the replicas end with it."""
    import uvicorn

    from shoal.frontend.tokenizer import get_tokenizer
    from shoal.routing.policy import RoutingPolicy
    from shoal.routing.router import Router, build_app

    routing_policy = RoutingPolicy(policy)  # a bad policy fails before anything starts
    world_size = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    devices = gpu_split(engine_args.device, num_replicas, world_size)
    replicas = start_local_replicas(argv, num_replicas, devices)
    try:
        wait_until_ready(replicas)
        model = engine_args.model
        if model is None:
            from shoal.demo_model import ensure_demo_model

            model = ensure_demo_model()
        router = Router(
            [r.endpoint for r in replicas],
            routing_policy,
            block_size=engine_args.block_size,
            tokenizer=get_tokenizer(engine_args.tokenizer or model),
            session_header=session_header,
            base_model_names=base_model_names(replicas[0].endpoint.url),
        )
        logger.info(
            "shoal is routing (%s) over %d replicas at http://%s:%d/v1",
            policy,
            num_replicas,
            server_args.host,
            server_args.port,
        )
        uvicorn.run(build_app(router), host=server_args.host, port=server_args.port, log_level="warning")
    finally:
        for replica in replicas:
            replica.stop()
