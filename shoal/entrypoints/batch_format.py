"""The OpenAI batch file format, as `shoal batch` reads and writes it.

Input, one JSON object a line:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output, one line per input line, in the order requests finish (match them by `custom_id`):

    {"id": "batch_req_...", "custom_id": "q1", "error": null,
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}}}

A request the server would answer with a 4xx gets its status and the OpenAI error body in
`response` (as OpenAI's batch output has it); a line that is not a request at all (not JSON, no
`custom_id`, an unknown `url`) gets `"response": null` and `"error": {"code", "message"}`.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The routes a batch line may name, as OpenAI's batch API spells them.
BATCH_URLS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class BatchLine:
    """One well-formed input line: the request to make."""

    line_number: int  # 1-based, for messages
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class BadLine:
    """An input line that names no request; it becomes an error line."""

    line_number: int
    custom_id: str | None
    message: str

    @property
    def output_id(self) -> str:
        """A fixed id, so that a resumed run knows the line is done even without a custom_id."""
        return f"batch_req_line_{self.line_number}"


def parse_line(line_number: int, text: str) -> BatchLine | BadLine:
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        return BadLine(line_number, None, f"line {line_number} is not valid JSON: {exc}")
    if not isinstance(item, dict):
        return BadLine(line_number, None, f"line {line_number} is not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(line_number, None, f"line {line_number} has no custom_id (a non-empty string)")
    problem = _request_problem(item)
    if problem:
        return BadLine(line_number, custom_id, f"line {line_number}: {problem}")
    return BatchLine(line_number, custom_id, item["url"], item["body"])


def _request_problem(item: dict[str, Any]) -> str | None:
    if item.get("method", "POST") != "POST":
        return f"method must be POST, not {item.get('method')!r}"
    if item.get("url") not in BATCH_URLS:
        return f"url must be one of {', '.join(BATCH_URLS)}, not {item.get('url')!r}"
    if not isinstance(item.get("body"), dict):
        return "body must be a JSON object"
    if item["body"].get("stream"):
        return "stream is not supported in a batch"
    return None


def read_input(path: str | Path) -> list[BatchLine | BadLine]:
    """Every non-blank line of the input file, parsed. Two requests with one `custom_id` are a
    `ValueError` (the output could not tell them apart, nor a resumed run skip only one)."""
    items: list[BatchLine | BadLine] = []
    first_seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for line_number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            item = parse_line(line_number, text)
            if item.custom_id is not None:
                if item.custom_id in first_seen:
                    raise ValueError(
                        f"custom_id {item.custom_id!r} appears on lines {first_seen[item.custom_id]} and "
                        f"{line_number} of {path}: each request needs its own"
                    )
                first_seen[item.custom_id] = line_number
            items.append(item)
    return items


def result_line(custom_id: str, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """The output line of a request that got an answer (a completion or an OpenAI error body)."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": body.get("id", ""), "body": body},
        "error": None,
    }


def bad_line_result(bad: BadLine) -> dict[str, Any]:
    return {
        "id": bad.output_id,
        "custom_id": bad.custom_id,
        "response": None,
        "error": {"code": "invalid_request", "message": bad.message},
    }


def done_ids(path: str | Path) -> set[str]:
    """The `custom_id`s and ids of the lines already in an output file (a resumed run skips
    them). A last line cut short by a killed run is removed, so that it is written again whole."""
    path = Path(path)
    if not path.exists():
        return set()
    done: set[str] = set()
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    for text in complete.decode("utf-8").splitlines():
        if not text.strip():
            continue
        line = json.loads(text)
        done.add(line["id"])
        if line.get("custom_id") is not None:
            done.add(line["custom_id"])
    return done


def is_done(item: BatchLine | BadLine, done: set[str]) -> bool:
    if isinstance(item, BadLine) and item.custom_id is None:
        return item.output_id in done
    return item.custom_id in done


class ResultWriter:
    """Appends output lines, each in one write and flushed to the OS at once, so that a job
    killed at any moment leaves whole lines (and at most a cut last line, see `done_ids`)."""

    def __init__(self, path: str | Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, line: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(line, separators=(",", ":")) + "\n").encode("utf-8"))

    def close(self) -> None:
        os.close(self._fd)
