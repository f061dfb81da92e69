"""The OpenAI API of a real `shoal serve` process (the demo model), through the official `openai`
client and raw HTTP: greedy outputs equal the offline `LLM`, streaming, n, logprobs, stop
strings, usage, tokenize/detokenize, health/version/metrics."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.server_utils import DEMO_KV_CACHE_BYTES, DEMO_MAX_MODEL_LEN, ServerProcess

PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,"]
CONVERSATION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def offline(demo_model_path: str) -> dict[str, Any]:
    """Greedy outputs of the offline `LLM` on the same model."""
    import torch

    from shoal import LLM, SamplingParams

    # One thread, as the server's engine has: the server process shares this machine's cores.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(
        demo_model_path,
        max_model_len=DEMO_MAX_MODEL_LEN,
        kv_cache_memory_bytes=DEMO_KV_CACHE_BYTES,
        multiprocess=False,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        completions = llm.generate(PROMPTS, params, use_tqdm=False)
        chat = llm.chat(CONVERSATION, params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
        torch.set_num_threads(num_threads)
    return {"completions": completions, "chat": chat}


def test_models(client: openai.OpenAI, server: ServerProcess) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [server.model_name]
    assert client.models.retrieve(server.model_name).id == server.model_name


def test_greedy_completions_equal_offline_llm(client: openai.OpenAI, server: ServerProcess, offline: dict) -> None:
    response = client.completions.create(model=server.model_name, prompt=PROMPTS, temperature=0, max_tokens=MAX_TOKENS)
    expected = offline["completions"]
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [o.outputs[0].text for o in expected]
    assert [c.finish_reason for c in response.choices] == [o.outputs[0].finish_reason for o in expected]
    assert response.usage is not None
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert response.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_greedy_completion_stream_equals_offline_llm(
    client: openai.OpenAI, server: ServerProcess, offline: dict
) -> None:
    stream = client.completions.create(
        model=server.model_name,
        prompt=PROMPTS[0],
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    *content, last = chunks
    expected = offline["completions"][0].outputs[0]
    assert "".join(c.choices[0].text for c in content) == expected.text
    assert content[-1].choices[0].finish_reason == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert all(c.usage is None for c in content)
    assert last.choices == []
    assert last.usage is not None and last.usage.completion_tokens == len(expected.token_ids)


def test_greedy_chat_equals_offline_llm(client: openai.OpenAI, server: ServerProcess, offline: dict) -> None:
    expected = offline["chat"]
    response = client.chat.completions.create(
        model=server.model_name, messages=CONVERSATION, temperature=0, max_tokens=MAX_TOKENS
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)
    # max_completion_tokens is the newer name of max_tokens.
    again = client.chat.completions.create(
        model=server.model_name, messages=CONVERSATION, temperature=0, max_completion_tokens=MAX_TOKENS
    )
    assert again.choices[0].message.content == expected.outputs[0].text


def test_chat_stream(client: openai.OpenAI, server: ServerProcess, offline: dict) -> None:
    stream = client.chat.completions.create(
        model=server.model_name,
        messages=CONVERSATION,
        temperature=0,
        max_tokens=MAX_TOKENS,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage_chunk = chunks.pop()
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    expected = offline["chat"].outputs[0]
    assert usage_chunk.usage.completion_tokens == 2 * len(expected.token_ids)
    for index in (0, 1):
        deltas = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert deltas[0].delta.role == "assistant" and deltas[0].delta.content == ""
        assert "".join(d.delta.content or "" for d in deltas) == expected.text
        assert deltas[-1].finish_reason == expected.finish_reason
        assert all(d.finish_reason is None for d in deltas[:-1])


def test_token_id_prompts(client: openai.OpenAI, server: ServerProcess, offline: dict) -> None:
    token_ids = [list(o.prompt_token_ids) for o in offline["completions"][:2]]
    response = client.completions.create(
        model=server.model_name, prompt=token_ids, temperature=0, max_tokens=MAX_TOKENS
    )
    assert [c.text for c in response.choices] == [o.outputs[0].text for o in offline["completions"][:2]]
    single = client.completions.create(model=server.model_name, prompt=token_ids[0], temperature=0, max_tokens=4)
    assert len(single.choices) == 1


def test_n_and_logprobs(client: openai.OpenAI, server: ServerProcess) -> None:
    response = client.completions.create(
        model=server.model_name, prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=1.0, seed=7, logprobs=3
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.usage is not None
    assert response.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in response.choices)
    for choice in response.choices:
        logprobs = choice.logprobs
        assert logprobs is not None
        num_tokens = len(logprobs.tokens)
        assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == num_tokens
        assert all(lp <= 0 for lp in logprobs.token_logprobs)
        assert all(3 <= len(top) <= 4 for top in logprobs.top_logprobs)  # the top 3 and the sampled token
        for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
            assert top[token] == logprob
        for i in range(num_tokens - 1):
            assert logprobs.text_offset[i + 1] == logprobs.text_offset[i] + len(logprobs.tokens[i])
    # A seed makes sampling reproducible.
    again = client.completions.create(
        model=server.model_name, prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=1.0, seed=7, logprobs=3
    )
    assert [c.text for c in again.choices] == [c.text for c in response.choices]


def test_echo_with_logprobs(client: openai.OpenAI, server: ServerProcess, offline: dict) -> None:
    response = client.completions.create(
        model=server.model_name, prompt=PROMPTS[0], echo=True, logprobs=1, max_tokens=4, temperature=0
    )
    choice = response.choices[0]
    num_prompt_tokens = len(offline["completions"][0].prompt_token_ids)
    assert choice.text.startswith(PROMPTS[0])
    assert offline["completions"][0].outputs[0].text.startswith(choice.text[len(PROMPTS[0]) :])
    assert choice.logprobs is not None
    assert len(choice.logprobs.tokens) == num_prompt_tokens + 4
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    assert "".join(choice.logprobs.tokens[:num_prompt_tokens]) == PROMPTS[0]


def test_stop_strings(client: openai.OpenAI, server: ServerProcess, offline: dict) -> None:
    full = offline["completions"][0].outputs[0].text  # " Paris.\n\nThe answer is: ..."
    stop = full.strip()[3:6]
    cut = full[: full.index(stop)]
    response = client.completions.create(
        model=server.model_name, prompt=PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS, stop=[stop, "never"]
    )
    assert response.choices[0].text == cut
    assert response.choices[0].finish_reason == "stop"
    included = client.completions.create(
        model=server.model_name,
        prompt=PROMPTS[0],
        temperature=0,
        max_tokens=MAX_TOKENS,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert included.choices[0].text == cut + stop
    streamed = client.completions.create(
        model=server.model_name, prompt=PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS, stop=[stop], stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    chat_full = offline["chat"].outputs[0].text
    chat_stop = chat_full.strip().split()[2]
    chat = client.chat.completions.create(
        model=server.model_name, messages=CONVERSATION, temperature=0, max_tokens=MAX_TOKENS, stop=chat_stop
    )
    assert chat.choices[0].message.content == chat_full[: chat_full.index(chat_stop)]
    assert chat.choices[0].finish_reason == "stop"


def test_chat_logprobs(client: openai.OpenAI, server: ServerProcess) -> None:
    response = client.chat.completions.create(
        model=server.model_name, messages=CONVERSATION, temperature=0, max_tokens=5, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert response.usage is not None and len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the most likely
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(e.token for e in content) == response.choices[0].message.content
    streamed = client.chat.completions.create(
        model=server.model_name,
        messages=CONVERSATION,
        temperature=0,
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    streamed_tokens = [
        e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert streamed_tokens == [e.token for e in content]


def test_extra_sampling_fields(client: openai.OpenAI, server: ServerProcess) -> None:
    response = client.completions.create(
        model=server.model_name,
        prompt=PROMPTS[0],
        max_tokens=8,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=3,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 8,
            "ignore_eos": True,
            "stop_token_ids": [],
            "skip_special_tokens": True,
        },
    )
    assert response.usage is not None and response.usage.completion_tokens == 8
    assert response.choices[0].finish_reason == "length"


def test_tokenize_and_detokenize(server: ServerProcess, offline: dict) -> None:
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tokens["tokens"] == list(offline["completions"][0].prompt_token_ids)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == DEMO_MAX_MODEL_LEN
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CONVERSATION}).json()
    assert chat["tokens"] == list(offline["chat"].prompt_token_ids)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": PROMPTS[0]}


def test_health_version_metrics(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    version = httpx.get(f"{server.url}/version").json()
    assert version["engine_core_pid"] == server.engine_core_pid and version["version"]
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "shoal:request_success_total",
        "shoal:prompt_tokens_total",
        "shoal:generation_tokens_total",
        "shoal:time_to_first_token_seconds_bucket",
        "shoal:inter_token_latency_seconds_bucket",
        "shoal:time_per_output_token_seconds_bucket",
        "shoal:e2e_request_latency_seconds_bucket",
        "shoal:num_requests_running",
        "shoal:num_requests_waiting",
        "shoal:kv_cache_usage_perc",
        "shoal:prefix_cache_queries_total",
        "shoal:prefix_cache_hits_total",
        "shoal:num_used_kv_blocks",
    ):
        assert name in text, name
    assert f'shoal:num_used_kv_blocks{{model_name="{server.model_name}"}}' in text
    assert server.metric("shoal:generation_tokens_total") > 0
    # The periodic stats line is in the log.
    assert "Avg prompt throughput:" in server.log() and "Prefix cache hit rate:" in server.log()


def test_sse_wire_format(server: ServerProcess) -> None:
    """Raw SSE: `data: {...}` events separated by blank lines, ending in `data: [DONE]`."""
    body = {"prompt": "Hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(e.startswith("data: ") for e in events)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 3
