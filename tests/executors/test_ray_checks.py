"""The cluster-failure messages of `ray_checks`: what differs between a worker node and the
driver, a missing model folder, a process group that does not form, a dead GCS address."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from shoal.executors import ray_checks
from tests.ray_nodes import free_ports


def test_other_versions_and_a_missing_model_folder_are_named(tmp_path: Path) -> None:
    driver = dataclasses.replace(ray_checks.local_versions(), torch="0.0.1", shoal="9.9.9")
    problems = ray_checks.environment_problems(driver, str(tmp_path / "absent"), "cpu")
    assert len(problems) == 2
    assert "(the driver has 0.0.1)" in problems[0] and "(the driver has 9.9.9)" in problems[0]
    assert "install the same Python packages on every node" in problems[0]
    assert f"the model folder '{tmp_path / 'absent'}' is missing on this node" in problems[1]
    assert ray_checks.environment_problems(ray_checks.local_versions(), str(tmp_path), "cpu") == []
    message = ray_checks.node_problems_message([(1, "10.0.0.2", problems)])
    assert message.splitlines()[1].startswith("  worker rank 1 on node 10.0.0.2: torch")


def test_distributed_setup_message_names_the_interface_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")
    message = ray_checks.distributed_setup_message("tcp://10.0.0.1:1234", 25.0, None)
    assert "rendezvous tcp://10.0.0.1:1234) did not finish within 25 s" in message
    assert "GLOO_SOCKET_IFNAME='bogus0'" in message and "NCCL_SOCKET_IFNAME" in message


def test_a_dead_gcs_address_fails_at_once() -> None:
    (port,) = free_ports(1)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=f"No Ray cluster answers at 127.0.0.1:{port} \\(RAY_ADDRESS\\)"):
        ray_checks.check_gcs_reachable(f"127.0.0.1:{port}", "RAY_ADDRESS")
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("strategy", "num_bundles", "rule"),
    [
        ("STRICT_SPREAD", 3, "3 nodes that hold one each"),
        ("STRICT_PACK", 3, "one node that holds all 3"),
        ("PACK", 5, "room for 5 over all nodes"),
        ("SPREAD", 5, "room for 5 over all nodes"),
    ],
)
def test_a_placement_no_node_set_can_hold_is_named_with_each_node(strategy: str, num_bundles: int, rule: str) -> None:
    nodes = [
        ray_checks.NodeResources("node a", {"CPU": 2.0}, {"CPU": 1.0}),
        ray_checks.NodeResources("node b", {"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0}),
    ]
    message = ray_checks.infeasible_placement_message({"CPU": 1.0}, num_bundles, strategy, nodes)
    assert message is not None and f"with placement strategy {strategy} (it needs {rule})" in message
    assert "  node a: CPU 2 (1 free): 2 bundle(s)" in message and "  node b: CPU 2 (2 free): 2 bundle(s)" in message
    feasible = {"STRICT_SPREAD": 2, "STRICT_PACK": 2, "PACK": 4, "SPREAD": 4}[strategy]
    assert ray_checks.infeasible_placement_message({"CPU": 1.0}, feasible, strategy, nodes) is None
    assert ray_checks.infeasible_placement_message({"GPU": 1.0}, 1, strategy, nodes) is None


def test_a_cuda_worker_actor_without_a_gpu_says_so(ray_cluster: dict, tmp_path: Path) -> None:
    """Provoked for real: a worker task that would run on CUDA, on a node Ray gave no GPU."""
    import ray

    check = ray.remote(num_cpus=0)(ray_checks.environment_problems)
    problems = ray.get(check.remote(ray_checks.local_versions(), str(tmp_path), "cuda"), timeout=120)
    assert len(problems) == 1 and "no usable GPU in the worker actor (Ray assigned none" in problems[0]
    assert "ray start --num-gpus=N" in problems[0] and "do not set CUDA_VISIBLE_DEVICES" in problems[0]


def test_a_process_group_on_a_missing_interface_names_the_variables(
    ray_cluster: dict, tiny_checkpoints: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Provoked for real: GLOO_SOCKET_IFNAME names no interface, so the TP=2 group cannot form."""
    from shoal import LLM

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")  # forwarded to every worker
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="GLOO_SOCKET_IFNAME='bogus0'") as error:
        LLM(str(tiny_checkpoints["llama"]), tensor_parallel_size=2, multiprocess=False)
    assert "NCCL_SOCKET_IFNAME" in str(error.value) and time.monotonic() - start < 30
