"""The fused-MoE tuner's search and table writing (benchmarks/tune_fused_moe.py), on the CPU: the
local search against made-up timings (the GPU is what times real launches)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from shoal.kernels.triton import fused_moe_config as cfg
from shoal.kernels.triton.fused_moe_config import MoEGemmConfig

ROOT = Path(__file__).resolve().parents[2]
TUNER = ROOT / "benchmarks/tune_fused_moe.py"


@pytest.fixture(scope="module")
def tuner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tune_fused_moe", TUNER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def _bowl(best: MoEGemmConfig, tuner: ModuleType):
    """A made-up launch time that grows with each parameter's steps away from `best`, and the
    launches it was asked for."""
    asked: list[MoEGemmConfig] = []

    def time_of(config: MoEGemmConfig) -> float:
        asked.append(config)
        steps = sum(
            abs(values.index(getattr(config, field)) - values.index(getattr(best, field)))
            for field, values in tuner.AXES.items()
        )
        return 100.0 + 7.0 * steps

    return time_of, asked


def test_local_search_reaches_the_fastest_launch_timing_few(tuner: ModuleType) -> None:
    best = MoEGemmConfig(128, 64, 1, 8, 4)
    start = MoEGemmConfig(32, 256, 16, 4, 2)
    time_of, asked = _bowl(best, tuner)
    timed = tuner.climb(time_of, start, max_moves=32)
    assert min(timed, key=lambda t: t[0]) == (100.0, best)
    assert len(asked) == len(set(asked))  # nothing timed twice
    grid = 1
    for values in tuner.AXES.values():
        grid *= len(values)
    assert len(asked) < grid / 4, (len(asked), grid)


def test_local_search_from_the_fastest_times_only_its_neighbours(tuner: ModuleType) -> None:
    best = MoEGemmConfig(64, 128, 8, 4, 3)
    time_of, asked = _bowl(best, tuner)
    tuner.climb(time_of, best)
    assert asked[0] == best and sorted(asked[1:], key=str) == sorted(tuner.neighbours(best), key=str)
    # one step on one axis each: n and k and stages both ways, group both ways, warps up
    assert len(asked) == 1 + 2 + 2 + 2 + 1 + 2


def test_a_known_launch_close_to_the_fastest_is_kept(tuner: ModuleType) -> None:
    known, new = MoEGemmConfig(64, 64), MoEGemmConfig(128, 64)
    assert tuner.pick([(101.0, known), (100.0, new)], {known}) == (101.0, known)
    assert tuner.pick([(110.0, known), (100.0, new)], {known}) == (100.0, new)


def test_block_m_tries_its_neighbours(tuner: ModuleType) -> None:
    assert tuner.block_m_neighbours(16) == [16, 32]
    assert tuner.block_m_neighbours(64) == [32, 64, 128]
    assert tuner.block_m_neighbours(48) == [48]


def test_update_without_a_table_keeps_the_whole_grid(tmp_path: Path) -> None:
    """`--update` of a shape nobody tuned yet writes the full grid (the heuristic's launches
    where it did not tune), not only the re-tuned batch sizes."""
    command = [sys.executable, str(TUNER), "--heuristic", "--update"]
    command += ["--model", str(ROOT / "benchmarks/configs/deepseek-v2-lite"), "--token-counts", "200"]
    command += ["--out-dir", str(tmp_path), "--device-name", "TEST_GPU"]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    written = json.loads((tmp_path / cfg.config_file_name(64, 1408, "TEST_GPU", "bfloat16")).read_text())
    assert sorted(int(count) for count in written) == sorted({200, *cfg.TOKEN_COUNTS})
    assert written["1"] == cfg.heuristic_launch(1, 64, 6).to_json()
