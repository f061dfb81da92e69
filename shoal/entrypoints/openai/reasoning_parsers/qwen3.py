"""Qwen3: the model opens its thinking itself with `<think>` and closes it with `</think>`; an
output that does not start with `<think>` (thinking turned off) is all answer. Under a
structured-output constraint the first token is `<think>` or the answer's first token."""

from __future__ import annotations

from shoal.entrypoints.openai.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    model_opens_thinking = True

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            return self._split_thinking(stripped, final)
        if not final and self.start.startswith(stripped):
            return None, None  # too early to tell
        return None, text
