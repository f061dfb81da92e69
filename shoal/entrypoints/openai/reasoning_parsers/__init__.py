"""Reasoning parsers by `--reasoning-parser` name (vLLM's names)."""

from __future__ import annotations

from shoal.entrypoints.openai.reasoning_parsers.base import ReasoningParser
from shoal.entrypoints.openai.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from shoal.entrypoints.openai.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}

__all__ = ["REASONING_PARSERS", "ReasoningParser", "get_reasoning_parser"]


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; shoal has {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()
