"""The tiny drafters the proposers' tests load (tests/spec_decode/drafter_checkpoints.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.spec_decode.drafter_checkpoints import add_mtp_layer, make_eagle3_head, make_eagle_head


@pytest.fixture(scope="session")
def eagle3_head(tiny_checkpoints, tmp_path_factory) -> Path:
    """An EAGLE-3 head for tiny_checkpoints["llama"], in the published layout."""
    return make_eagle3_head(tmp_path_factory.mktemp("eagle3") / "head", tiny_checkpoints["llama"])


@pytest.fixture(scope="session")
def eagle_head(tiny_checkpoints, tmp_path_factory) -> Path:
    """An EAGLE head for tiny_checkpoints["llama"]."""
    return make_eagle_head(tmp_path_factory.mktemp("eagle") / "head", tiny_checkpoints["llama"])


@pytest.fixture(scope="session")
def deepseek_mtp(deepseek_checkpoints, tmp_path_factory) -> Path:
    """deepseek_checkpoints["deepseek_v3"] with a next-token module after its 3 decoder layers."""
    return add_mtp_layer(deepseek_checkpoints["deepseek_v3"], tmp_path_factory.mktemp("mtp") / "deepseek_v3_mtp")
