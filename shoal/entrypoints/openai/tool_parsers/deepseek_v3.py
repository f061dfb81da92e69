"""DeepSeek-V3 tool calls, written with the special tokens of its tokenizer after any text:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

DeepSeek-V3.1's template drops the type and the fence (`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
<｜tool▁call▁end｜>`); a call in either form is read, so one parser serves both."""

from __future__ import annotations

from shoal.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolCallDraft, ToolParser, held_back
from shoal.entrypoints.openai.tool_parsers.json_scan import skip_whitespace, value_end

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```json"


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    special_tokens = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        starts = [at for at in (text.find(CALLS_BEGIN), text.find(CALL_BEGIN)) if at >= 0]
        if not starts:
            return ParsedOutput(content=text if final else held_back(text, (CALLS_BEGIN, CALL_BEGIN)))
        first = min(starts)
        parsed = ParsedOutput(content=text[:first])
        position = text.find(CALL_BEGIN, first)
        while position >= 0:
            call, end = _call(text, position + len(CALL_BEGIN))
            if call is None:
                break
            parsed.calls.append(call)
            if end is None:
                break
            position = text.find(CALL_BEGIN, end)
        return parsed


def _call(text: str, start: int) -> tuple[ToolCallDraft | None, int | None]:
    """The call whose head starts at `start` (None while its name is incomplete), and where its
    arguments end (None while they are being written)."""
    sep = text.find(SEP, start)
    if sep < 0:
        return None, None
    head, after = text[start:sep].strip(), sep + len(SEP)
    if head == "function":  # V3: the name on its own line, then the arguments in a json fence
        newline = text.find("\n", after)
        if newline < 0:
            return None, None
        name = text[after:newline].strip()
        fence = skip_whitespace(text, newline)
        if not text.startswith(FENCE, fence):
            return ToolCallDraft(name=name, arguments=""), None
        arguments_start = skip_whitespace(text, fence + len(FENCE))
    else:  # V3.1: the name before the separator, the arguments right after it
        name, arguments_start = head, skip_whitespace(text, after)
    if arguments_start >= len(text):
        return ToolCallDraft(name=name, arguments=""), None
    end = value_end(text, arguments_start)
    arguments = text[arguments_start : end if end is not None else len(text)]
    return ToolCallDraft(name=name, arguments=arguments, complete=end is not None), end
