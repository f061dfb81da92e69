"""POST /start_profile and /stop_profile: present only with $SHOAL_TORCH_PROFILER_DIR set (as
vLLM's) and behind the API key when one is set, profiling the engine-core process while the
server answers."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server_utils import ServerProcess


def test_profile_routes_write_a_trace_of_the_served_requests(
    tiny_model_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHOAL_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    args = [tiny_model_path, "--max-model-len", "256", "--api-key", "profile-key"]
    server = ServerProcess(args, tmp_path / "server.log")
    auth = {"Authorization": "Bearer profile-key"}
    try:
        for route in ("start_profile", "stop_profile"):
            refused = httpx.post(f"{server.url}/{route}", timeout=60)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        stop = httpx.post(f"{server.url}/stop_profile", headers=auth, timeout=60)
        assert stop.status_code == 400 and "no profile is running" in stop.json()["error"]["message"]
        assert httpx.post(f"{server.url}/start_profile", headers=auth, timeout=60).status_code == 200
        client = server.client(api_key="profile-key")
        completion = client.completions.create(model=server.model_name, prompt="hello there", max_tokens=4)
        assert completion.choices[0].text is not None
        response = httpx.post(f"{server.url}/stop_profile", headers=auth, timeout=60)
        assert response.status_code == 200
        [summary] = response.json()
        trace = Path(summary["trace"])
        assert trace.parent == tmp_path / "traces" and trace.stat().st_size > 0 and "aten::" in summary["table"]
    finally:
        server.stop()


def test_profile_routes_are_absent_by_default(server: ServerProcess) -> None:
    assert httpx.post(f"{server.url}/start_profile", timeout=30).status_code == 404
