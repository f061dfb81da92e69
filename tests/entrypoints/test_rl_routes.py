"""The RL rollout routes of `shoal serve --enable-rl-endpoints` (/sleep, /wake_up, /is_sleeping,
/pause, /resume, /is_paused), driven by an HTTP client: behind the API key, bad values are 400s
that change nothing, completions come out the same after a sleep, and a request sent while
paused waits for /resume. Without the flag the routes do not exist."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.server_utils import ServerProcess

API_KEY = "rl-secret"
PROMPT = "The quick brown fox"
ROUTES = [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/pause")]


@pytest.fixture(scope="module")
def rl_server(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("rl-server") / "server.log"
    args = [tiny_model_path, "--max-model-len", "256", "--enable-rl-endpoints", "--api-key", API_KEY]
    process = ServerProcess(args, log_path)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def http(rl_server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=rl_server.url, headers=headers, timeout=60) as client:
        yield client


def complete(http: httpx.Client, rl_server: ServerProcess) -> list[int]:
    body = {"model": rl_server.model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_sleep_and_wake_up_over_http(http: httpx.Client, rl_server: ServerProcess) -> None:
    before = complete(http, rl_server)
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.post("/sleep", params={"level": 1}).json() == {"is_sleeping": True}
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert http.post("/wake_up", params={"tags": "weights"}).json() == {"is_sleeping": True}
    assert http.post("/wake_up", json={"tags": ["kv_cache"]}).json() == {"is_sleeping": False}
    assert complete(http, rl_server) == before
    assert http.post("/sleep", json={"level": 1}).status_code == 200
    assert http.post("/wake_up").json() == {"is_sleeping": False}
    assert complete(http, rl_server) == before


def test_pause_holds_a_request_until_resume(http: httpx.Client, rl_server: ServerProcess) -> None:
    expected = complete(http, rl_server)
    assert http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).json() == {"is_paused": True}
    assert http.get("/is_paused").json() == {"is_paused": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(complete, http, rl_server)
        time.sleep(1.0)
        assert not waiting.done()
        assert http.post("/resume").json() == {"is_paused": False}
        assert waiting.result(timeout=60) == expected
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.post("/pause", json={"mode": "wait"}).status_code == 200  # nothing runs: returns at once
    assert http.post("/resume").status_code == 200


@pytest.mark.parametrize(
    ("path", "kwargs", "param"),
    [
        ("/sleep", {"params": {"level": 3}}, None),
        ("/sleep", {"params": {"level": "deep"}}, "level"),
        ("/wake_up", {"json": {"tags": ["activations"]}}, None),
        ("/wake_up", {"json": {"tags": 7}}, "tags"),
        ("/pause", {"params": {"mode": "retract"}}, None),
        ("/pause", {"params": {"clear_cache": "maybe"}}, "clear_cache"),
        ("/pause", {"content": b"[1, 2]", "headers": {"Content-Type": "application/json"}}, None),
    ],
)
def test_bad_values_are_400s_that_change_nothing(
    http: httpx.Client, rl_server: ServerProcess, path: str, kwargs: dict, param: str | None
) -> None:
    response = http.post(path, **kwargs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert http.get("/is_paused").json() == {"is_paused": False}


def test_the_routes_need_the_api_key(rl_server: ServerProcess) -> None:
    for method, path in ROUTES:
        response = httpx.request(method, f"{rl_server.url}{path}", timeout=30)
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_the_routes_are_absent_without_the_flag(server: ServerProcess) -> None:
    """The session's server (started without the flag)."""
    for method, path in [*ROUTES, ("POST", "/resume"), ("GET", "/is_paused")]:
        response = httpx.request(method, f"{server.url}{path}", timeout=30)
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found"
