"""Reading JSON that is still being written: where a value starting at some offset ends (None
while it is incomplete), and an object's members so far. Tool-call parsers use it to stream a
call's name as soon as it is complete and its arguments as raw text as they grow (a prefix of
the final arguments' text, since the model's text only grows)."""

from __future__ import annotations

import json
from dataclasses import dataclass

_WHITESPACE = " \t\n\r"
# Characters that end a number or a literal (true, false, null).
_SCALAR_END = ",}] \t\n\r"


@dataclass
class Member:
    """One member of an object: its key, and where its value starts and ends in the text (end
    None while the value is incomplete; start None while not even begun)."""

    key: str
    value_start: int | None
    value_end: int | None

    def raw(self, text: str) -> str:
        """The value's text so far."""
        if self.value_start is None:
            return ""
        return text[self.value_start : self.value_end if self.value_end is not None else len(text)]


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def string_end(text: str, start: int) -> int | None:
    """The end (exclusive) of the string whose opening quote is `text[start]`."""
    i = start + 1
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, start: int) -> int | None:
    """The end (exclusive) of the JSON value starting at `text[start]`; None if incomplete (a
    number or literal that reaches the end of the text may go on)."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return string_end(text, start)
    if first not in "{[":
        i = start
        while i < len(text) and text[i] not in _SCALAR_END:
            i += 1
        return i if i < len(text) else None
    depth, i = 0, start
    while i < len(text):
        char = text[i]
        if char == '"':
            end = string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def object_members(text: str, start: int) -> tuple[list[Member], int | None]:
    """The members of the object whose `{` is `text[start]`, as far as the text goes, and the
    object's end (exclusive; None while it is incomplete or malformed)."""
    members: list[Member] = []
    i = start + 1
    while True:
        i = skip_whitespace(text, i)
        if i >= len(text):
            return members, None
        if text[i] == "}":
            return members, i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return members, None
        key_end = string_end(text, i)
        if key_end is None:
            return members, None
        key = json.loads(text[i:key_end])
        i = skip_whitespace(text, key_end)
        if i >= len(text) or text[i] != ":":
            return members, None
        i = skip_whitespace(text, i + 1)
        if i >= len(text):
            members.append(Member(key, None, None))
            return members, None
        end = value_end(text, i)
        members.append(Member(key, i, end))
        if end is None:
            return members, None
        i = end


def array_elements(text: str, start: int) -> tuple[list[tuple[int, int | None]], int | None]:
    """The (start, end) of each element of the array whose `[` is `text[start]` so far, and the
    array's end (exclusive; None while incomplete)."""
    elements: list[tuple[int, int | None]] = []
    i = start + 1
    while True:
        i = skip_whitespace(text, i)
        if i >= len(text):
            return elements, None
        if text[i] == "]":
            return elements, i + 1
        if text[i] == ",":
            i += 1
            continue
        end = value_end(text, i)
        elements.append((i, end))
        if end is None:
            return elements, None
        i = end
