"""Helpers shared by the model files: config lookups and the checkpoint-name bookkeeping of
`load_weights` (fused projections, pipeline stages)."""

from __future__ import annotations

import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def head_dim_of(hf_config: Any) -> int:
    """config.head_dim when set (Qwen3, some Mistrals), else hidden_size / num_attention_heads."""
    return int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads)


def layer_index(name: str) -> int | None:
    """The decoder layer a checkpoint name belongs to ("model.layers.7.mlp..." -> 7), or None."""
    match = _LAYER_INDEX.match(name)
    return int(match.group(1)) if match else None


def warn_if_sliding_window(hf_config: Any) -> None:
    """Sliding-window attention is not implemented: full attention is exact only while
    sequences stay within the window."""
    window = getattr(hf_config, "sliding_window", None)
    enabled = getattr(hf_config, "use_sliding_window", True)
    if window and enabled:
        logger.warning(
            "sliding_window=%d is ignored: attention is full, so sequences longer than the window "
            "will differ from the reference model",
            window,
        )
