"""The CPU worker's torch thread count: the usable physical cores less one, capped by a cgroup
quota; SHOAL_CPU_THREADS overrides it."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.workers import cpu_threads


@pytest.mark.parametrize(("text", "quota"), [("max 100000\n", None), ("150000 100000\n", 1.5), ("garbage", None)])
def test_cgroup_cpu_quota(tmp_path: Path, text: str, quota: float | None) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(text)
    assert cpu_threads.cgroup_cpu_quota(path) == quota
    assert cpu_threads.cgroup_cpu_quota(tmp_path / "missing") is None


@pytest.mark.parametrize(("cores", "quota", "expected"), [(1, None, 1), (2, None, 1), (16, None, 15), (16, 4.0, 3)])
def test_default_is_the_usable_physical_cores_less_one(monkeypatch, cores: int, quota: float | None, expected: int):
    # Two hyperthreads per core: logical CPUs 2k and 2k + 1 are core k.
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(2 * cores)))
    monkeypatch.setattr(cpu_threads, "_core_of", lambda cpu: ("0", str(cpu // 2)))
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: quota)
    assert cpu_threads.default_cpu_threads() == expected


def test_worker_takes_the_default_or_the_override(tiny_checkpoints: dict, monkeypatch) -> None:
    import torch

    from shoal import envs
    from shoal.config import EngineArgs
    from shoal.workers.worker import Worker

    config = EngineArgs(model=str(tiny_checkpoints["llama"]), device="cpu").create_engine_config()
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(envs, "SHOAL_CPU_THREADS", 0)
        Worker(config).init_device()
        assert torch.get_num_threads() == cpu_threads.default_cpu_threads()
        monkeypatch.setattr(envs, "SHOAL_CPU_THREADS", 3)
        Worker(config).init_device()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
