"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
block per call, after any text (Qwen2.5, Qwen3, Hermes 2 Pro / 3 chat templates)."""

from __future__ import annotations

from shoal.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolParser, draft_from_members, held_back
from shoal.entrypoints.openai.tool_parsers.json_scan import object_members, skip_whitespace

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(START)
        if first < 0:
            return ParsedOutput(content=text if final else held_back(text, (START,)))
        parsed = ParsedOutput(content=text[:first])
        position: int | None = first
        while position is not None and position >= 0:
            body = skip_whitespace(text, position + len(START))
            if body >= len(text) or text[body] != "{":
                break
            members, end = object_members(text, body)
            parsed.calls.append(draft_from_members(members, text, end is not None, ("arguments", "parameters")))
            position = text.find(START, end) if end is not None else None
        return parsed
