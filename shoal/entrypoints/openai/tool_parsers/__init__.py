"""Tool-call parsers by `--tool-call-parser` name (vLLM's names)."""

from __future__ import annotations

from shoal.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallDraft, ToolCallStreamer, ToolParser
from shoal.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from shoal.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from shoal.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from shoal.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV3ToolParser,
}

__all__ = ["TOOL_PARSERS", "ParsedOutput", "ToolCallDraft", "ToolCallStreamer", "ToolParser", "get_tool_parser"]


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; shoal has {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
