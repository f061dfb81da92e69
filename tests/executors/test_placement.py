"""Placement for colocated training: the engine's workers go into the bundles of a placement
group the caller made (`placement_group=`, `bundle_indices=` in rank order), answer correctly
there, and the caller's group outlives the engine. Bad placements are a `ValueError` that names
the problem, before any worker starts.

Where the workers landed is read twice: from Ray's own record (the state API: an actor placed in
bundle i of group g requires the resource `bundle_group_<i>_<g>`) and from `report_device`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from shoal import LLM, SamplingParams
from shoal.config import EngineArgs, ParallelConfig
from shoal.executors import ray_utils
from tests.hf_reference import hf_greedy
from tests.workers.test_worker_extension import EXTENSION, check_extension

PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def callers_group(ray_cluster: dict) -> Iterator[Any]:
    """Three one-CPU bundles, as a trainer would reserve them (named, so it can be found); no
    test changes it."""
    import ray

    group = ray.util.placement_group([{"CPU": 1}] * 3, name="trainer-group")
    ray.get(group.ready(), timeout=60)
    yield group
    ray.util.remove_placement_group(group)


def bundles_of_engine_workers(group_id: str) -> dict[str, int]:
    """Worker actor name -> the bundle of `group_id` Ray placed it in."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE"), ("ray_namespace", "=", "shoal")], detail=True)
    placed = {}
    for actor in actors:
        for resource in actor.required_resources or {}:
            match = re.fullmatch(rf"bundle_group_(\d+)_{group_id}", resource)
            if match:
                placed[actor.name] = int(match.group(1))
    return placed


@pytest.mark.timeout(180)
def test_tp2_engine_on_the_callers_bundles_2_and_1(callers_group: Any, tiny_checkpoints: dict) -> None:
    """As an RL trainer starts its engine: in its own group, with a worker extension (whose
    check on two Ray workers is made here, on the same engine, to start one engine fewer)."""
    from ray.util.placement_group import placement_group_table

    path = str(tiny_checkpoints["llama"])
    group_id = callers_group.id.hex()
    placement = dict(placement_group=callers_group, bundle_indices=[2, 1], worker_extension_cls=EXTENSION)
    with LLM(path, tensor_parallel_size=2, **placement) as llm:
        prompt_ids = llm.get_tokenizer().encode(PROMPT)
        output = llm.generate([{"prompt_token_ids": prompt_ids}], GREEDY, use_tqdm=False)[0]
        assert (
            output.outputs[0].token_ids == hf_greedy(path, prompt_ids, GREEDY.max_tokens, stop_at_eos=False).token_ids
        )
        placed = bundles_of_engine_workers(group_id)
        # Rank r's actor is "shoal-worker-<engine id>-<r>-<incarnation>": rank 0 in bundle 2, rank 1 in 1.
        by_rank = {int(name.split("-")[-2]): bundle for name, bundle in placed.items()}
        assert by_rank == {0: 2, 1: 1}
        devices = llm.collective_rpc("report_device")
        assert [device.rsplit(":", 1)[1] for device in devices] == ["2", "1"]
        assert all(device.startswith("cpu:") for device in devices)
        check_extension(llm, path, num_workers=2)
    assert placement_group_table(callers_group)["state"] == "CREATED"  # the engine left the caller's group
    assert bundles_of_engine_workers(group_id) == {}


def test_placement_group_by_name_with_fractional_workers(callers_group: Any) -> None:
    """`shoal serve --placement-group NAME`: the group is found by its name; half a CPU a worker."""
    group, ranks, owned = ray_utils.reserve_placement_group(
        2, "cpu", 10.0, ParallelConfig(placement_group="trainer-group", bundle_indices=(0, 2), num_cpus_per_worker=0.5)
    )
    assert group.id == callers_group.id and ranks == [0, 2] and not owned


@pytest.mark.parametrize(
    ("parallel", "error"),
    [
        (dict(placement_group="no-such-group"), "no placement group named 'no-such-group'"),
        (dict(bundle_indices=(0, 5)), "bundle index 5 is out of range: the placement group has 3 bundles"),
        (dict(bundle_indices=(0, 1), num_cpus_per_worker=2.0), r"bundle 0 of the placement group .* lacks"),
    ],
)
def test_bad_placements_name_the_problem(callers_group: Any, parallel: dict, error: str) -> None:
    parallel.setdefault("placement_group", callers_group)
    with pytest.raises(ValueError, match=error):
        ray_utils.reserve_placement_group(2, "cpu", 10.0, ParallelConfig(**parallel))


def test_bundle_indices_without_a_group(ray_cluster: dict) -> None:
    with pytest.raises(ValueError, match="bundle_indices needs a placement group"):
        ray_utils.reserve_placement_group(2, "cpu", 10.0, ParallelConfig(bundle_indices=(0, 1)))


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (dict(tensor_parallel_size=2, bundle_indices=[1]), r"one bundle per worker \(2\)"),
        (dict(tensor_parallel_size=2, bundle_indices=[1, 1]), "name a bundle twice"),
        (dict(bundle_indices=[0], distributed_executor_backend="uni"), "need the 'ray' executor"),
        (dict(placement_group=3), "must be a Ray PlacementGroup or its name"),
        (dict(num_gpus_per_worker=1.5), r"num_gpus_per_worker must be in \(0, 1\]"),
        (dict(num_cpus_per_worker=0), "num_cpus_per_worker must be > 0"),
    ],
)
def test_bad_placement_arguments(tiny_checkpoints: dict, args: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        EngineArgs(model=str(tiny_checkpoints["llama"]), device="cpu", **args).create_engine_config()


def test_a_placement_group_alone_chooses_the_ray_executor(tiny_checkpoints: dict) -> None:
    config = EngineArgs(model=str(tiny_checkpoints["llama"]), device="cpu", placement_group="g").create_engine_config()
    assert config.parallel_config.distributed_executor_backend == "ray"
    assert ray_utils.worker_bundle("cuda", ParallelConfig(num_gpus_per_worker=0.4)) == {"GPU": 0.4}


def test_serve_flags() -> None:
    from shoal.cli import engine_args_from, make_parser

    flags = ["--placement-group", "trainer-group", "--bundle-indices", "2", "1", "--num-gpus-per-worker", "0.4"]
    engine_args = engine_args_from(make_parser().parse_args(["serve", *flags]))
    assert engine_args.placement_group == "trainer-group"
    assert engine_args.bundle_indices == (2, 1)
    assert engine_args.num_gpus_per_worker == 0.4
