"""Placement groups: rank order by node, a clear error when the cluster is too small, and shoal
started from inside a user's Ray actor using the actor's placement group."""

from __future__ import annotations

import pytest

from shoal.executors import ray_utils


def test_bundles_on_the_driver_node_get_the_lowest_ranks() -> None:
    nodes = {0: "node-b", 1: "node-a", 2: "driver", 3: "node-b", 4: "driver"}
    assert ray_utils.order_bundles([0, 1, 2, 3, 4], nodes, "driver") == [2, 4, 1, 0, 3]


def test_cpu_workers_get_one_thread_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("UNRELATED_VARIABLE", "1")
    monkeypatch.delenv("SHOAL_CPU_THREADS", raising=False)
    env = ray_utils.worker_env_vars("cpu")
    assert env["SHOAL_CPU_THREADS"] == "1" and env["NCCL_DEBUG"] == "INFO"
    assert "UNRELATED_VARIABLE" not in env
    assert ray_utils.worker_bundle("cuda") == {"GPU": 1.0}


def test_a_placement_the_cluster_can_never_hold_fails_at_once(ray_cluster: dict) -> None:
    with pytest.raises(RuntimeError, match=r"can never place 64 worker bundles") as error:
        ray_utils.reserve_placement_group(64, "cpu", timeout_s=60.0)
    assert "(head): CPU 4 (" in str(error.value) and ": 4 bundle(s)" in str(error.value)


def test_a_placement_held_by_others_times_out_naming_the_missing_resources(ray_cluster: dict) -> None:
    import ray

    holder = ray.util.placement_group([{"CPU": 1.0}] * 3)  # another job's group, holding 3 of 4 CPUs
    ray.get(holder.ready(), timeout=60)
    try:
        with pytest.raises(RuntimeError, match=r"CPU: 2 needed, 4 in the cluster, 1 free"):
            ray_utils.reserve_placement_group(2, "cpu", timeout_s=1.0)
    finally:
        ray.util.remove_placement_group(holder)


def test_engine_inside_a_ray_actor_uses_the_actors_placement_group(ray_cluster: dict, tiny_checkpoints: dict) -> None:
    import ray
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 1}] * 2)
    ray.get(group.ready(), timeout=60)

    @ray.remote(num_cpus=0)  # the bundles are for the engine's workers
    class Generator:
        def generate(self, path: str) -> tuple[list[int], bool]:
            from shoal import LLM, SamplingParams

            llm = LLM(path, tensor_parallel_size=2, multiprocess=False)
            output = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
            executor = llm.engine_core.core.executor
            in_callers_group = executor.placement_group.id == ray.util.get_current_placement_group().id
            llm.shutdown()
            return output[0].outputs[0].token_ids, in_callers_group

    strategy = PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
    generator = Generator.options(scheduling_strategy=strategy).remote()
    try:
        token_ids, in_callers_group = ray.get(generator.generate.remote(str(tiny_checkpoints["llama"])), timeout=120)
        assert len(token_ids) == 4 and in_callers_group
        # The engine was given the group, so its shutdown left the group alone.
        assert placement_group_table(group)["state"] == "CREATED"
    finally:
        ray.kill(generator)
        ray.util.remove_placement_group(group)
