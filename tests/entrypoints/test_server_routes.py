"""vLLM's extra routes on the session's demo-model server: `GET /load` (requests in flight) and
`POST /invocations` (SageMaker's route: a chat completion or a completion by the body's shape)."""

from __future__ import annotations

import time

import httpx

from tests.entrypoints.server_utils import ServerProcess

CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def _load(server: ServerProcess) -> int:
    response = httpx.get(f"{server.url}/load", timeout=30)
    assert response.status_code == 200
    return response.json()["server_load"]


def _wait_for_load(server: ServerProcess, value: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _load(server) != value:
        assert time.monotonic() < deadline, f"/load stayed at {_load(server)}, expected {value}"
        time.sleep(0.05)


def test_load_counts_the_requests_being_answered(server: ServerProcess) -> None:
    _wait_for_load(server, 0)  # what earlier tests left has ended
    body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=120) as http,
        http.stream("POST", "/v1/completions", json=body) as first,
        http.stream("POST", "/v1/completions", json=body) as second,
    ):
        # (Kept: an httpx line iterator that is dropped closes its response.)
        lines = [first.iter_lines(), second.iter_lines()]
        assert all(next(stream).startswith("data: ") for stream in lines)  # both under way
        assert _load(server) == 2
        assert all(list(stream)[-2] == "data: [DONE]" for stream in lines)
    _wait_for_load(server, 0)  # a response's end ends its load


def test_invocations_answers_as_the_route_the_body_names(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        chat = http.post("/invocations", json=CHAT).json()
        assert chat["object"] == "chat.completion"
        direct = http.post("/v1/chat/completions", json=CHAT).json()
        assert chat["choices"][0]["message"] == direct["choices"][0]["message"]

        completion = http.post("/invocations", json=COMPLETION).json()
        assert completion["object"] == "text_completion"
        assert (
            completion["choices"][0]["text"]
            == http.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
        )

        streamed = http.post("/invocations", json={**COMPLETION, "stream": True})
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.text.rstrip().endswith("data: [DONE]")

        neither = http.post("/invocations", json={"max_tokens": 4})
        assert neither.status_code == 400
        assert "'messages'" in neither.json()["error"]["message"]
        bad = http.post("/invocations", json={"messages": "hello"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "messages"
        assert http.post("/invocations", json=[1]).status_code == 400
