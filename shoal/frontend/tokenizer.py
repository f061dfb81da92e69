"""Loading a model's tokenizer and its stop tokens (transformers' AutoTokenizer)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from shoal.config import explain_remote_code

logger = logging.getLogger(__name__)

# A folder holding none of these has no tokenizer (a config.json alone, for load_format="dummy").
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def get_tokenizer(path: str) -> Any | None:
    """The tokenizer in `path`; None for a folder with no tokenizer files (prompts must then be
    token ids, and outputs carry token ids but no text)."""
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).exists() for name in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer: prompts must be token ids, and outputs have no text", path)
        return None
    from transformers import AutoTokenizer

    try:
        # Never code from the folder (a tokenizer class of its own): see `explain_remote_code`.
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {explain_remote_code(exc)}") from exc


def generation_eos_token_ids(model_path: str) -> list[int]:
    """Extra end-of-sequence ids from generation_config.json (Llama 3 lists several)."""
    path = Path(model_path) / "generation_config.json"
    if not path.exists():
        return []
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(model_path, trust_remote_code=False).eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
