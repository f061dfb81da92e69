"""Fixtures for the benchmark tests: one torch thread (a 2-core CI machine oversubscribed by
OpenMP slows tiny models down many times over) and a config-only model folder."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    import torch

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="session")
def config_only_model(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding only the tiny Qwen3 checkpoint's config.json: no weights, no tokenizer."""
    folder = tmp_path_factory.mktemp("config_only")
    shutil.copy(tiny_checkpoints["qwen3"] / "config.json", folder / "config.json")
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    return folder
