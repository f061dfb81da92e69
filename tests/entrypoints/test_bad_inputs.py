"""Every row of bad_inputs.py against the shared server: its status, an OpenAI error body (for a
4xx), the headers it must carry, and no effect on the next request; docs/bad_inputs.md in sync."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.entrypoints.bad_inputs import BAD_INPUTS, BadInput, markdown
from tests.entrypoints.server_utils import ServerProcess

DOCS = Path(__file__).parents[2] / "docs" / "bad_inputs.md"


@pytest.mark.parametrize("row", BAD_INPUTS, ids=[row.what for row in BAD_INPUTS])
def test_bad_input_gets_its_status_and_changes_nothing(server: ServerProcess, row: BadInput) -> None:
    kwargs: dict[str, Any] = {}
    if isinstance(row.body, bytes):
        kwargs = {"content": row.body, "headers": {"Content-Type": "application/json"}}
    elif row.body is not None:
        kwargs = {"json": row.body}
    response = httpx.request(row.method, f"{server.url}{row.path}", timeout=60, **kwargs)
    assert response.status_code == row.status, response.text
    for header in row.headers:
        assert response.headers.get(header), (header, dict(response.headers))
    if row.status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert row.message in error["message"], error
    good = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["completion_tokens"] == 2


def test_the_docs_table_is_in_sync() -> None:
    assert DOCS.read_text() == markdown(), "run: python -m tests.entrypoints.bad_inputs > docs/bad_inputs.md"


def test_a_body_not_sent_as_json_is_told_its_content_type(server: ServerProcess) -> None:
    body = b'{"prompt": "Hi", "max_tokens": 2}'
    response = httpx.post(
        f"{server.url}/v1/completions", content=body, headers={"Content-Type": "text/plain"}, timeout=60
    )
    assert response.status_code == 400
    assert "sent with Content-Type: application/json" in response.json()["error"]["message"]
