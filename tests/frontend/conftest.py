from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_path: str) -> Any:
    from shoal.frontend.tokenizer import get_tokenizer

    return get_tokenizer(demo_model_path)
