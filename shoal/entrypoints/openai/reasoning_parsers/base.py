"""Reasoning parsers: split a reasoning model's output into its thinking (`reasoning_content`)
and its answer (`content`) at the `<think>` ... `</think>` markers.

`split(text, final)` reads the whole output so far; with `final=False` (a stream) it holds back
text that may be the start of a marker, so that both parts only ever grow. `end_token_ids`
(the tokenizer's encoding of the end marker) tells the engine where a structured-output grammar
starts: it constrains the answer only.
"""

from __future__ import annotations

from typing import Any

from shoal.entrypoints.openai.tool_parsers.base import held_back

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    start, end = START, END

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of the output so far; None where a part has not begun."""
        raise NotImplementedError

    def _split_thinking(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """`text` is the thinking, then (after the end marker) the answer."""
        if text.startswith(self.start):
            text = text[len(self.start) :]
        elif not final and self.start.startswith(text):
            return None, None
        end = text.find(self.end)
        if end < 0:
            return (text if final else held_back(text, (self.end,))), None
        return text[:end], text[end + len(self.end) :]

    def end_token_ids(self, tokenizer: Any) -> list[int]:
        return list(tokenizer.encode(self.end, add_special_tokens=False))

    def prompt_ends_thinking(self, prompt: str) -> bool:
        """The chat template closed the thinking already (thinking turned off): the whole
        output is the answer."""
        return prompt.rstrip().endswith(self.end)
