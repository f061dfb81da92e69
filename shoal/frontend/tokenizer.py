"""Loading a model's tokenizer and its stop tokens (transformers' AutoTokenizer)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def get_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {exc}") from exc


def generation_eos_token_ids(model_path: str) -> list[int]:
    """Extra end-of-sequence ids from generation_config.json (Llama 3 lists several)."""
    path = Path(model_path) / "generation_config.json"
    if not path.exists():
        return []
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
