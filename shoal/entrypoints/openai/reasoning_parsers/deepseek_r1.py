"""DeepSeek-R1 (and its distills): the chat template opens the thinking in the prompt, so the
output starts inside it (a leading `<think>` is dropped) and ends it with `</think>`. An output
that never closes it is all reasoning (under a structured-output constraint too: the grammar
starts after `</think>`)."""

from __future__ import annotations

from shoal.entrypoints.openai.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        return self._split_thinking(text, final)
