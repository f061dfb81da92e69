"""The RL rollout routes of `shoal serve --enable-rl-endpoints` (/sleep, /wake_up, /is_sleeping,
/pause, /resume, /is_paused, the weight updates, /weight_version), driven by an HTTP client:
behind the API key, bad values are 400s that change nothing, completions come out the same after
a sleep, a request sent while paused waits for /resume, and a trainer in this process syncs new
weights over gloo that a folder then replaces. Without the flag the routes do not exist."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.entrypoints.server_utils import ServerProcess

API_KEY = "rl-secret"
PROMPT = "The quick brown fox"
ROUTES = [
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/pause"),
    ("POST", "/init_weight_update_group"),
    ("POST", "/update_weights_from_distributed"),
    ("POST", "/update_weights_from_disk"),
    ("POST", "/destroy_weight_update_group"),
    ("GET", "/weight_version"),
    # SGLang's and vLLM's spellings (tests/entrypoints/test_rl_native_apis.py).
    ("POST", "/generate"),
    ("POST", "/pause_generation"),
    ("POST", "/init_weights_update_group"),
    ("POST", "/abort_request"),
    ("GET", "/v1/loads"),
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/inference/v1/generate"),
]


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
        ("/update_weights_from_disk", {"json": {}}, "path"),
        ("/update_weights_from_disk", {"json": {"path": "/no/such/folder"}}, None),
        ("/update_weights_from_distributed", {"json": {"names": "w", "dtypes": [], "shapes": []}}, "names"),
        (
            "/update_weights_from_distributed",
            {"json": {"names": ["w"], "dtypes": ["float32"], "shapes": [[2.5]]}},
            "shapes",
        ),
        # No weight-update group: refused before anything is received.
        (
            "/update_weights_from_distributed",
            {"json": {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}},
            None,
        ),
        (
            "/init_weight_update_group",
            {"json": {"master_address": "127.0.0.1", "master_port": 1, "world_size": 1}},
            None,
        ),
        ("/init_weight_update_group", {"json": {"master_address": "127.0.0.1", "world_size": 2}}, "master_port"),
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
    assert http.get("/weight_version").json() == {"weight_version": "0"}


def test_weight_updates_over_http(http: httpx.Client, rl_server: ServerProcess, tiny_model_path: str, tmp_path) -> None:
    """A trainer in this process broadcasts changed weights while /update_weights_from_distributed
    waits for them; the same weights from a folder give the same completion, and the original
    folder the original one. Runs after the tests above, which expect version "0"."""
    from tests.ray_nodes import free_ports
    from tests.rl.rl_utils import Trainer

    before = complete(http, rl_server)
    trainer = Trainer(tiny_model_path)
    trainer.train_step(seed=1)
    (port,) = free_ports(1)
    group = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(trainer.start_sender, port, 2, 128 << 10)
        assert http.post("/init_weight_update_group", json=group).json() == {"success": True}
        joined.result(timeout=60)
        again = http.post("/init_weight_update_group", json=group)
        assert again.status_code == 400 and "already in a weight-update group" in again.json()["error"]["message"]
        sent = pool.submit(trainer.send)
        response = http.post(
            "/update_weights_from_distributed", json={**trainer.metadata(), "weight_version": "step-1"}
        )
        assert response.json() == {"success": True, "weight_version": "step-1"}, response.text
        assert sent.result(timeout=60) >= 2
    assert http.post("/destroy_weight_update_group").json() == {"success": True}
    trainer.close()
    assert http.get("/weight_version").json() == {"weight_version": "step-1"}
    changed = complete(http, rl_server)
    assert changed != before
    changed_folder = trainer.save(str(tmp_path / "step-1"))
    try:
        assert http.post("/update_weights_from_disk", json={"path": tiny_model_path}).status_code == 200
        assert complete(http, rl_server) == before
        response = http.post("/update_weights_from_disk", json={"model_path": changed_folder, "weight_version": "disk"})
        assert response.json() == {"success": True, "weight_version": "disk"}
        assert complete(http, rl_server) == changed
    finally:
        http.post("/update_weights_from_disk", params={"path": tiny_model_path, "weight_version": "0"})


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
