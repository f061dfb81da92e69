"""A Ray cluster of several nodes on this machine, each node its own `ray start --block` process
(cluster/start_head.sh, cluster/start_worker.sh) with its own resources, ports and temp dir, for
the tests of shoal on a multi-node cluster. Stopping it stops exactly the processes it started."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def node_port_flags() -> list[str]:
    """Every port a node listens on, chosen free, so that several nodes share one machine."""
    names = (
        "node-manager-port",
        "object-manager-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "metrics-export-port",
        "runtime-env-agent-port",
    )
    return [f"--{name}={port}" for name, port in zip(names, free_ports(len(names)))]


@dataclass
class LocalCluster:
    """`num_nodes` nodes of `cpus_per_node` logical CPUs; node i > 0 also has resource `node<i>`."""

    num_nodes: int = 3
    cpus_per_node: int = 2
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="shoal-rs-")))
    processes: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gcs_port, self.dashboard_port, self.client_port = free_ports(3)
        import ray

        self.ip = ray.util.get_node_ip_address()
        # Every process of every node imports this checkout's shoal, and never asks for a token.
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(
            RAY_AUTH_MODE="disabled",
            RAY=RAY,
            RAY_PORT=str(self.gcs_port),
            NODE_IP=self.ip,
            # A loaded machine registers a node slowly; Ray's default gives up after 60 s.
            RAY_raylet_start_wait_time_s="180",
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            SHOAL_LOGGING_LEVEL="WARNING",
            RAY_DEDUP_LOGS="0",
        )

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.ip}:{self.dashboard_port}"

    def driver_env(self, **extra: str) -> dict[str, str]:
        """The environment of a process that should join this cluster."""
        return {**self.env, "RAY_ADDRESS": self.address, **extra}

    def start(self) -> None:
        common = [f"--temp-dir={self.temp_dir}", "--block", f"--num-cpus={self.cpus_per_node}"]
        head = [
            str(REPO / "cluster/start_head.sh"),
            *common,
            f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-host={self.ip}",
            f"--ray-client-server-port={self.client_port}",
            *node_port_flags(),
        ]
        self._spawn(head, "head")
        # One node after the other: nodes that start together on a loaded machine time out.
        self._wait_until_up(num_nodes=1)
        for i in range(1, self.num_nodes):
            worker = [
                str(REPO / "cluster/start_worker.sh"),
                self.address,
                *common,
                f"--resources={json.dumps({f'node{i}': 1})}",
                *node_port_flags(),
            ]
            self._spawn(worker, f"node{i}")
            self._wait_until_up(num_nodes=i + 1)

    def _spawn(self, argv: list[str], name: str) -> None:
        with open(self.temp_dir / f"{name}.log", "w") as log:
            self.processes.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=log, start_new_session=True))

    def _wait_until_up(self, num_nodes: int, timeout_s: float = 120.0) -> None:
        """Until `num_nodes` nodes are alive and the job API answers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.dashboard}/nodes?view=summary", timeout=2) as response:
                    nodes = json.load(response)["data"]["nodeLogicalResources"]
                if len(nodes) >= num_nodes:
                    with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=2):
                        return
            except (OSError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the cluster did not come up:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.temp_dir.glob("*.log")))

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to each `ray start --block` stops the Ray processes of its node, given
        `grace_s` in all (a graceful stop of a loaded node can take half a minute, and nothing
        here needs it graceful); then SIGKILL. The agents it leaves behind (they outlive their
        raylet) are found by their files in this temp dir."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in reversed(self.processes):
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)  # its own session, started here
                process.wait()
        for pid in self.leftover_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def leftover_pids(self) -> list[int]:
        """The live processes whose command line or open files name this cluster's temp dir."""
        marker = str(self.temp_dir)
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if "State:\tZ" in (entry / "status").read_text():
                    continue
                names = [(entry / "cmdline").read_bytes().decode(errors="replace")]
                names += [os.readlink(fd) for fd in (entry / "fd").iterdir()]
            except OSError:
                continue  # ended meanwhile, or not ours to read
            if any(marker in name for name in names):
                pids.append(int(entry.name))
        return pids
