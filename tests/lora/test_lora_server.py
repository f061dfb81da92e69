"""LoRA over HTTP: `--lora-modules` at start, the `model` field choosing an adapter (greedy equal
to transformers + peft), `/v1/models` with each adapter's parent, load and unload while other
requests run, bad adapters a 400 with the server still serving, the lora_requests_info gauge."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from shoal.config import EngineArgs
from shoal.entrypoints.openai.api_server import ServerArgs, build_app
from shoal.entrypoints.openai.lora_routes import parse_lora_module
from shoal.frontend.async_llm import AsyncLLM
from shoal.lora.request import LoRARequest
from tests.lora.adapters import make_adapter, peft_greedy

PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def server_adapters(tiny_checkpoints: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server_adapters")
    base = tiny_checkpoints["llama"]
    return {
        "first": make_adapter(base, root / "first", seed=11),
        "second": make_adapter(base, root / "second", seed=12),
    }


def _complete(client: TestClient, model: str, max_tokens: int = 6, prompt: list[int] = PROMPT):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return client.post("/v1/completions", json=body)


def _token_ids(client: TestClient, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    response = client.post("/v1/completions", json={**body, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_adapters_over_http(tiny_checkpoints: dict, server_adapters: dict, tmp_path) -> None:
    base = tiny_checkpoints["llama"]
    engine = AsyncLLM(EngineArgs(model=str(base), enable_lora=True, max_loras=1, max_lora_rank=8), multiprocess=False)
    args = ServerArgs(
        lora_modules=(parse_lora_module(f"first={server_adapters['first']}"),),
        enable_runtime_lora_updating=True,
        stats_interval_s=0,
    )
    with TestClient(build_app(engine, args, shutdown_engine=True)) as client:
        models = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in models] == [str(base), "first"]
        assert models[1]["parent"] == str(base) and models[1]["root"] == str(server_adapters["first"])
        assert _token_ids(client, "first", PROMPT, 6) == peft_greedy(base, server_adapters["first"], PROMPT, 6)
        assert _complete(client, "second").status_code == 404
        chat = {"model": "first", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert client.post("/v1/chat/completions", json=chat).json()["model"] == "first"

        # Other requests run (the base model and "first") while "second" is loaded, used, unloaded.
        with ThreadPoolExecutor(4) as pool:
            others = [pool.submit(_complete, client, m, 24) for m in (str(base), "first", str(base), "first")]
            load = client.post(
                "/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": str(server_adapters["second"])}
            )
            assert load.status_code == 200, load.text
            assert (
                client.post("/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": "x"}).status_code == 400
            )
            assert _token_ids(client, "second", PROMPT, 6) == peft_greedy(base, server_adapters["second"], PROMPT, 6)
            assert all(f.result().status_code == 200 for f in others)
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "second"}).status_code == 200
        assert _complete(client, "second").status_code == 404
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "second"}).status_code == 400

        bad = client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "none")})
        assert bad.status_code == 400 and "has no adapter_config.json" in bad.json()["error"]["message"]
        wide = tmp_path / "wide"
        make_adapter(base, wide, r=16, seed=13)  # over max_lora_rank=8
        too_wide = client.post("/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(wide)})
        assert too_wide.status_code == 400 and "over max_lora_rank=8" in too_wide.json()["error"]["message"]
        assert _complete(client, str(base)).status_code == 200  # still serving

        metrics = client.get("/metrics").text
        assert 'shoal:lora_requests_info{max_lora="1"' in metrics


def test_lora_modules_flag_forms() -> None:
    named = parse_lora_module("sql=/adapters/sql")
    assert isinstance(named, LoRARequest) and (named.lora_name, named.lora_path) == ("sql", "/adapters/sql")
    spec = parse_lora_module('{"name": "chat", "path": "/adapters/chat", "base_model_name": "base"}')
    assert (spec.lora_name, spec.lora_path, spec.base_model_name) == ("chat", "/adapters/chat", "base")
    for bad in ("no-equals", "=path", '{"name": "x"}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
