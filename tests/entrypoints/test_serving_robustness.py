"""The shared demo-model server under load and abuse: 64 concurrent streams, clients that leave
mid-request, and typed client errors (the table of bad inputs is test_bad_inputs.py). KV-block leaks are checked through `/metrics` (`shoal:num_used_kv_blocks`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.server_utils import DEMO_MAX_MODEL_LEN, ServerProcess

# Long enough that finishing would take far longer than the abort checks allow.
LONG_MAX_TOKENS = 900
ABORT_DEADLINE_S = 10.0


def test_64_concurrent_streams_complete_and_free_their_blocks(server: ServerProcess) -> None:
    num_requests, max_tokens = 64, 6

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=server.model_name,
            prompt=f"Request {i}: tell me about the number {i}.",
            max_tokens=max_tokens,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish_reason, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish_reason = chunk.choices[0].finish_reason or finish_reason
            usage = chunk.usage or usage
        assert finish_reason == "length"
        return text, usage.completion_tokens

    async def all_requests() -> list[tuple[str, int]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(num_requests)))
        finally:
            await client.close()

    results = asyncio.run(all_requests())
    assert len(results) == num_requests
    assert all(num_tokens == max_tokens for _, num_tokens in results)
    server.wait_for_metric("shoal:num_requests_running", 0, timeout_s=10)
    assert server.metric("shoal:num_used_kv_blocks") == 0
    assert server.metric("shoal:num_requests_waiting") == 0


def _long_request(stream: bool) -> dict[str, Any]:
    return {
        "prompt": "Count forever:",
        "max_tokens": LONG_MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def test_client_disconnect_mid_stream_aborts_the_request(server: ServerProcess) -> None:
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=_long_request(stream=True)) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        num_events = 0
        while num_events < 3:
            num_events += next(lines).startswith("data: ")
        assert server.metric("shoal:num_requests_running") == 1
        assert server.metric("shoal:num_used_kv_blocks") > 0
    # The connection is closed: the engine aborts the request and frees its blocks.
    server.wait_for_metric("shoal:num_requests_running", 0, timeout_s=ABORT_DEADLINE_S)
    server.wait_for_metric("shoal:num_used_kv_blocks", 0, timeout_s=ABORT_DEADLINE_S)


def test_client_disconnect_while_waiting_for_a_full_response_aborts_it(server: ServerProcess) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=_long_request(stream=False), timeout=2.0)
    server.wait_for_metric("shoal:num_requests_running", 0, timeout_s=ABORT_DEADLINE_S)
    server.wait_for_metric("shoal:num_used_kv_blocks", 0, timeout_s=ABORT_DEADLINE_S)


CONVERSATION = [{"role": "user", "content": "Hi"}]


def test_openai_client_raises_typed_errors(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(
            model=server.model_name, messages=CONVERSATION, max_tokens=DEMO_MAX_MODEL_LEN + 1
        )
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model_name, prompt="hi", max_tokens=2, stream=True, temperature=-1)
    start = time.monotonic()
    assert client.completions.create(model=server.model_name, prompt="hi", max_tokens=2).choices
    assert time.monotonic() - start < 30
