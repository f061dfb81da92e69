"""An SSE event is one line of data however odd the generated text: characters that JSON leaves
raw but `str.splitlines` breaks lines at (NEL, U+2028, U+2029; httpx's `aiter_lines` splits so)
are escaped, and the event still parses to the same text. Found by the long soak, where the
demo model wrote one of them into a completion."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from shoal.entrypoints.openai.serving import sse_event


class Chunk(BaseModel):
    text: str


@pytest.mark.parametrize("text", ["a\x85b", "a\u2028b", "a\u2029b", "é\u2028好\x0b\x1c\x1d\x1e\x0c\n\r"])
def test_an_event_is_one_line_that_parses_back(text: str) -> None:
    for payload in (Chunk(text=text), {"text": text}):
        event = sse_event(payload)
        assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1, repr(event)
        assert json.loads(event.removeprefix("data: "))["text"] == text
