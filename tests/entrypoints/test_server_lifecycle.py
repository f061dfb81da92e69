"""Servers of their own: the API key, the body-size limit and SIGTERM (a tiny random checkpoint,
which starts fast), and the engine-core process dying under in-flight requests."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.server_utils import DEMO_MAX_MODEL_LEN, DEMO_SERVER_ARGS, ServerProcess, process_exists

API_KEY = "sesame"
BODY_LIMIT_BYTES = 4096


def test_api_key_body_limit_and_clean_sigterm(tiny_model_path: str, tmp_path: Path) -> None:
    server = ServerProcess(
        [tiny_model_path, "--api-key", API_KEY, "--max-request-body-bytes", str(BODY_LIMIT_BYTES)],
        tmp_path / "server.log",
    )
    try:
        url, good = f"{server.url}/v1/completions", {"prompt": "Hello", "max_tokens": 2}
        auth = {"Authorization": f"Bearer {API_KEY}"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = httpx.post(url, json=good, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        client = server.client(api_key=API_KEY)
        assert client.completions.create(model=server.model_name, prompt="Hello", max_tokens=2).choices
        # Probes need no key.
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/metrics").status_code == 200

        # Too large: declared by Content-Length, and sent chunked with no length.
        big = json.dumps({"prompt": "x" * BODY_LIMIT_BYTES, "max_tokens": 2}).encode()
        response = httpx.post(url, content=big, headers={**auth, "Content-Type": "application/json"})
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        chunks = iter([big[: len(big) // 2], big[len(big) // 2 :]])
        response = httpx.post(url, content=chunks, headers={**auth, "Content-Type": "application/json"})
        assert response.status_code == 413
        assert httpx.post(url, json=good, headers=auth).status_code == 200

        # SIGTERM: the server exits cleanly and takes its engine-core process with it.
        pid = server.engine_core_pid
        assert pid is not None and process_exists(pid)
    finally:
        exit_code = server.stop()
    assert exit_code == 0, server.log()
    assert not process_exists(pid)


@pytest.fixture
def fragile_server(demo_model_path: str, tmp_path: Path) -> Iterator[ServerProcess]:
    # The demo model (not the tiny one, which would finish a long request before the kill), one
    # request at a time, so that a second request is surely waiting when the engine dies.
    args = [demo_model_path, *DEMO_SERVER_ARGS, "--max-num-seqs", "1"]
    server = ServerProcess(args, tmp_path / "server.log")
    yield server
    server.stop()


def test_engine_core_death_fails_requests_and_health(fragile_server: ServerProcess) -> None:
    server = fragile_server
    assert httpx.get(f"{server.url}/health").status_code == 200
    pid = httpx.get(f"{server.url}/version").json()["engine_core_pid"]
    assert pid == server.engine_core_pid and process_exists(pid)
    body = {"prompt": "Hello", "max_tokens": DEMO_MAX_MODEL_LEN - 8, "ignore_eos": True}
    url = f"{server.url}/v1/completions"
    with (
        ThreadPoolExecutor(1) as pool,
        httpx.Client(timeout=30) as http,
        http.stream("POST", url, json={**body, "stream": True}) as stream,
    ):
        events = (line for line in stream.iter_lines() if line.startswith("data: "))
        next(events)  # the stream is running
        waiting = pool.submit(httpx.post, url, json=body, timeout=30)
        server.wait_for_metric("shoal:num_requests_waiting", 1, timeout_s=10)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()

        # The in-flight stream ends with an error event, then [DONE].
        rest = list(events)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["code"] == "engine_dead", rest[-2]
        assert time.monotonic() - killed_at < 5
        # The waiting request gets a 503.
        response = waiting.result(timeout=5)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        assert time.monotonic() - killed_at < 5

    assert httpx.get(f"{server.url}/health").status_code == 503
    response = httpx.post(url, json={"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 503
    with pytest.raises(openai.InternalServerError):
        server.client().chat.completions.create(
            model=server.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    # Nothing hangs: the server still shuts down cleanly.
    assert server.stop() == 0, server.log()
