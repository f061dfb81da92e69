"""Reasoning parsers: split a reasoning model's output into its thinking (`reasoning_content`)
and its answer (`content`) at the `<think>` ... `</think>` markers.

`split(text, final)` reads the whole output so far; with `final=False` (a stream) it holds back
text that may be the start of a marker, so that both parts only ever grow.

A structured-output constraint applies to the answer only: `constrain_answer` tells the engine
where the thinking is (the markers' token ids). A model can think only where each marker is one
token of its tokenizer (`marker_token_ids`) and the prompt has not closed the thinking already
(`prompt_ends_thinking`); otherwise its whole output is the answer, constrained from the first
token.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.entrypoints.openai.tool_parsers.base import held_back
from shoal.structured_output.params import StructuredOutputsParams

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    start, end = START, END
    # True: the model opens its thinking with the start marker as its first token (or answers
    # at once); False: the chat template opened it in the prompt.
    model_opens_thinking = False

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

    def marker_token_ids(self, tokenizer: Any) -> tuple[int, int] | None:
        """The start and end markers' token ids, where each is a single token of `tokenizer`;
        None where not (a model with such a tokenizer does not think)."""
        ids = [tokenizer.encode(marker, add_special_tokens=False) for marker in (self.start, self.end)]
        if any(len(marker_ids) != 1 for marker_ids in ids):
            return None
        return ids[0][0], ids[1][0]

    def constrain_answer(
        self, structured: StructuredOutputsParams, marker_token_ids: tuple[int, int]
    ) -> StructuredOutputsParams:
        """`structured`, applied after the thinking (its grammar leaves the thinking free)."""
        start, end = marker_token_ids
        return msgspec.structs.replace(
            structured,
            reasoning_end_token_ids=[end],
            reasoning_start_token_id=start if self.model_opens_thinking else None,
        )

    def prompt_ends_thinking(self, prompt: str) -> bool:
        """The chat template closed the thinking already (thinking turned off): the whole
        output is the answer."""
        return prompt.rstrip().endswith(self.end)
