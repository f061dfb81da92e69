"""Mistral tool calls after the `[TOOL_CALLS]` token: a JSON array of `{"name": ...,
"arguments": {...}}` (tokenizers before v11), or `name[ARGS]{...}` per call (v11 and later,
each call after its own `[TOOL_CALLS]`). Mistral's templates want call ids of 9 letters and
digits."""

from __future__ import annotations

import secrets
import string

from shoal.entrypoints.openai.tool_parsers.base import (
    ParsedOutput,
    ToolCallDraft,
    ToolParser,
    draft_from_members,
    held_back,
)
from shoal.entrypoints.openai.tool_parsers.json_scan import array_elements, object_members, skip_whitespace, value_end

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_ALPHABET = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    special_tokens = (TOOL_CALLS, ARGS)

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(TOOL_CALLS)
        if first < 0:
            return ParsedOutput(content=text if final else held_back(text, (TOOL_CALLS,)))
        parsed = ParsedOutput(content=text[:first])
        body = skip_whitespace(text, first + len(TOOL_CALLS))
        if body < len(text) and text[body] == "[":
            elements, _ = array_elements(text, body)
            for start, _ in elements:
                if text[start] != "{":
                    break
                members, object_end = object_members(text, start)
                parsed.calls.append(draft_from_members(members, text, object_end is not None, ("arguments",)))
            return parsed
        parsed.calls = _named_calls(text, first, final)
        return parsed


def _named_calls(text: str, position: int, final: bool) -> list[ToolCallDraft]:
    """`[TOOL_CALLS]name[ARGS]{...}` calls, from the marker at `position` on."""
    calls = []
    while position >= 0:
        name_start = position + len(TOOL_CALLS)
        args_at = text.find(ARGS, name_start)
        if args_at < 0:
            break  # the name is still being written
        arguments_start = skip_whitespace(text, args_at + len(ARGS))
        end = value_end(text, arguments_start) if arguments_start < len(text) else None
        arguments = text[arguments_start : end if end is not None else len(text)]
        calls.append(
            ToolCallDraft(name=text[name_start:args_at].strip(), arguments=arguments, complete=end is not None)
        )
        if end is None:
            break
        position = text.find(TOOL_CALLS, end)
    return calls
