"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole output is `{"name": ..., "parameters":
{...}}` (optionally after `<|python_tag|>`), several separated by `;`. An output that does not
start with a JSON object is plain content."""

from __future__ import annotations

from shoal.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolParser, draft_from_members
from shoal.entrypoints.openai.tool_parsers.json_scan import object_members, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    special_tokens = (PYTHON_TAG,)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_whitespace(text, start + len(PYTHON_TAG))
        rest = text[start:]
        if not final and (not rest or PYTHON_TAG.startswith(rest)):
            return ParsedOutput(content="")  # too early to tell a call from an answer
        if not rest.startswith("{"):
            return ParsedOutput(content=text)
        parsed = ParsedOutput(content="")
        position = start
        while position < len(text) and text[position] == "{":
            members, end = object_members(text, position)
            parsed.calls.append(draft_from_members(members, text, end is not None, ("parameters", "arguments")))
            if end is None:
                break
            position = skip_whitespace(text, end)
            if position < len(text) and text[position] == ";":
                position = skip_whitespace(text, position + 1)
        return parsed
