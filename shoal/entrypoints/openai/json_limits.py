"""What every request body must be before its fields are read: JSON nested at most
`MAX_JSON_DEPTH` deep, and text that can become UTF-8 (no lone surrogates).

JSON may spell a lone surrogate (`"\\udcff"`); Python keeps it in a `str`, and every tokenizer,
template and socket after that fails to encode it. A deeply nested body passes the JSON parser
yet can exhaust the stack of whatever walks it later (a chat template, a grammar compiler).
Both are refused here, once, with a message naming the place (a 400).
"""

from __future__ import annotations

from typing import Any

MAX_JSON_DEPTH = 64


def check_json_value(value: Any, path: str = "body", depth: int = 0) -> None:
    """Raise `ValueError` naming the first place where `value` is too deep or holds text that
    is not valid Unicode."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{path} is nested more than {MAX_JSON_DEPTH} levels deep")
    if isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(str(key), f"{path} key")
            check_json_value(item, f"{path}.{key}", depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_json_value(item, f"{path}[{index}]", depth + 1)


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{path} is not valid Unicode: a lone surrogate {text[exc.start]!r} at character {exc.start}"
        ) from None
