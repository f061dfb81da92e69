"""One chat choice's text split into what the API returns: the reasoning (`--reasoning-parser`),
the content, and the tool calls (the tool plan's parser), for the final message or, in a
stream, as deltas that only ever add to what was sent."""

from __future__ import annotations

from shoal.entrypoints.openai.protocol import DeltaMessage, ToolCall
from shoal.entrypoints.openai.reasoning_parsers import ReasoningParser
from shoal.entrypoints.openai.tool_parsers import ToolCallStreamer, ToolParser


class ChoiceOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.text = ""
        self._reasoning_sent = ""
        self._content_sent = ""
        self._streamer = ToolCallStreamer(tools) if tools is not None else None

    @property
    def num_tool_calls_sent(self) -> int:
        return self._streamer.num_calls if self._streamer is not None else 0

    def message(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) of a finished choice."""
        reasoning, content = self._split(text, final=True)
        if self.tools is None or content is None:
            return reasoning, content, []
        content, calls = self.tools.tool_calls(content)
        return reasoning, content, calls

    def delta(self, new_text: str, final: bool) -> DeltaMessage | None:
        """What a stream chunk says about `new_text` (None: nothing new to say yet)."""
        self.text += new_text
        reasoning, content = self._split(self.text, final)
        reasoning_delta = _grown(self._reasoning_sent, reasoning or "")
        self._reasoning_sent += reasoning_delta
        tool_calls = None
        if self._streamer is not None:
            content_delta, deltas = self._streamer.update(content or "", final)
            tool_calls = deltas or None
        else:
            content_delta = _grown(self._content_sent, content or "")
            self._content_sent += content_delta
        if not (reasoning_delta or content_delta or tool_calls):
            return None
        return DeltaMessage(
            reasoning_content=reasoning_delta or None, content=content_delta or None, tool_calls=tool_calls
        )

    def _split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text, final)


def _grown(sent: str, now: str) -> str:
    """What `now` adds to `sent` (nothing if it does not extend it)."""
    return now[len(sent) :] if now.startswith(sent) else ""
