"""A model folder with only config.json (dummy weights, no tokenizer) still serves token ids;
the text-only routes refuse with a 400 instead of failing inside."""

from __future__ import annotations

import shutil

from fastapi.testclient import TestClient

from shoal.config import EngineArgs
from shoal.entrypoints.openai.api_server import build_app
from shoal.frontend.async_llm import AsyncLLM


def test_config_only_model_refuses_text_routes_with_400(tiny_checkpoints: dict, tmp_path) -> None:
    shutil.copy(tiny_checkpoints["llama"] / "config.json", tmp_path / "config.json")
    engine = AsyncLLM(EngineArgs(model=str(tmp_path), load_format="dummy"), multiprocess=False)
    with TestClient(build_app(engine, shutdown_engine=True)) as client:
        for route, body in [("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [1, 2]})]:
            response = client.post(route, json=body)
            assert response.status_code == 400, response.text
            assert "tokenizer" in response.json()["error"]["message"]
        response = client.post("/v1/completions", json={"model": str(tmp_path), "prompt": [5, 6, 7], "max_tokens": 3})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
