"""What every tool-call parser gives: the text around the calls (`content`) and the calls so
far, each with its name once complete and its arguments' raw JSON text as far as written.

`parse(text, final)` reads the whole output so far; with `final=False` (a stream) it holds back
content that may be the start of a call marker, so that what it returns only ever grows.
`ToolCallStreamer` turns successive parses into OpenAI's `delta.tool_calls` chunks.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from shoal.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from shoal.entrypoints.openai.tool_parsers.json_scan import Member


@dataclass
class ToolCallDraft:
    name: str | None
    arguments: str  # raw JSON text so far
    complete: bool = False


@dataclass
class ParsedOutput:
    content: str
    calls: list[ToolCallDraft] = field(default_factory=list)


def tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class ToolParser:
    """A model family's tool-call format. `special_tokens` lists the markers that are special
    tokens of its tokenizers: requests with tools keep them in the text (skip_special_tokens
    off) so that the parser sees them."""

    name = ""
    special_tokens: tuple[str, ...] = ()

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return tool_call_id()

    def tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The final message: its content and calls. An output whose calls are incomplete or
        not JSON (cut off by max_tokens, say) is all content, with no calls."""
        parsed = self.parse(text, final=True)
        if not parsed.calls:
            return text, []
        calls = []
        for draft in parsed.calls:
            if draft.name is None or not draft.complete or not _is_json(draft.arguments):
                return text, []
            calls.append(
                ToolCall(id=self.new_call_id(), function=FunctionCall(name=draft.name, arguments=draft.arguments))
            )
        return (parsed.content if parsed.content.strip() else None), calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def draft_from_members(
    members: list[Member], text: str, complete: bool, arguments_keys: tuple[str, ...]
) -> ToolCallDraft:
    """A call from the members of its JSON object ({"name": ..., "arguments": {...}})."""
    name = None
    arguments = ""
    for member in members:
        if member.key == "name" and member.value_end is not None:
            value = json.loads(member.raw(text))
            name = value if isinstance(value, str) else None
        elif member.key in arguments_keys:
            arguments = member.raw(text)
    return ToolCallDraft(name=name, arguments=arguments, complete=complete)


def held_back(text: str, markers: tuple[str, ...]) -> str:
    """`text` without a tail that may be the start of one of `markers`."""
    for cut in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        tail = text[-cut:]
        if any(marker.startswith(tail) for marker in markers):
            return text[:-cut]
    return text


class ToolCallStreamer:
    """The `delta.tool_calls` of a stream: a call's first chunk carries its index, id, type and
    name (with empty arguments), later chunks the arguments' new text."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content_sent = ""
        self.arguments_sent: list[str] = []
        self.call_ids: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)

    def update(self, text: str, final: bool = False) -> tuple[str, list[DeltaToolCall]]:
        """The new content and the tool-call deltas since the last update, for the whole text so far."""
        parsed = self.parser.parse(text, final)
        content_delta = ""
        if parsed.content.startswith(self.content_sent):
            content_delta = parsed.content[len(self.content_sent) :]
            self.content_sent = parsed.content
        deltas = []
        for index, draft in enumerate(parsed.calls):
            if draft.name is None:
                break  # calls go out in order, each once its name is known
            if index == len(self.call_ids):
                self.call_ids.append(self.parser.new_call_id())
                self.arguments_sent.append("")
                deltas.append(
                    DeltaToolCall(
                        index=index,
                        id=self.call_ids[index],
                        type="function",
                        function=DeltaFunctionCall(name=draft.name, arguments=""),
                    )
                )
            new_arguments = draft.arguments[len(self.arguments_sent[index]) :]
            if new_arguments and draft.arguments.startswith(self.arguments_sent[index]):
                self.arguments_sent[index] = draft.arguments
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=new_arguments)))
        return content_delta, deltas
