from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import KINDS, make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind -> folder of a tiny random HF checkpoint with a tokenizer (see tests/checkpoints.py)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: make_checkpoint(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="session")
def demo_model_path() -> str:
    """The SmolLM2-135M-Instruct demo model, converted once per machine."""
    from shoal.demo_model import ensure_demo_model

    return ensure_demo_model()
