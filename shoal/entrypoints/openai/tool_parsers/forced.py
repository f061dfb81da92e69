"""Tool calls forced through structured output (`tool_choice` "required" or a named function),
whatever the model's own format: the output is JSON that the tool schemas constrain, read here.

- required: `[{"name": ..., "parameters": {...}}, ...]`, at least one call;
- named: the output is the named function's arguments.

The output is never an answer in words: one the grammar did not let finish (cut off by
`max_tokens`) is a fragment of a call (`[`, `{"city":`), so the message has no content and no
calls, and `finish_reason` says "length".
"""

from __future__ import annotations

from shoal.entrypoints.openai.protocol import ToolCall
from shoal.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallDraft, ToolParser, draft_from_members
from shoal.entrypoints.openai.tool_parsers.json_scan import array_elements, object_members, skip_whitespace, value_end


class ForcedToolCallParser(ToolParser):
    def tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        _, calls = super().tool_calls(text)
        return None, calls


class RequiredToolCallsParser(ForcedToolCallParser):
    name = "required"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        parsed = ParsedOutput(content="")
        start = skip_whitespace(text, 0)
        if start >= len(text) or text[start] != "[":
            return parsed
        elements, _ = array_elements(text, start)
        for element_start, _ in elements:
            if text[element_start] != "{":
                break
            members, end = object_members(text, element_start)
            parsed.calls.append(draft_from_members(members, text, end is not None, ("parameters",)))
        return parsed


class NamedToolCallParser(ForcedToolCallParser):
    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_whitespace(text, 0)
        end = value_end(text, start) if start < len(text) else None
        arguments = text[start : end if end is not None else len(text)]
        return ParsedOutput(content="", calls=[ToolCallDraft(self.function_name, arguments, complete=end is not None)])
