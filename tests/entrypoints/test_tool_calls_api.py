"""Tool calling on the session's demo-model server (started with `--tool-call-parser hermes
--enable-auto-tool-choice`), with a chat template that renders tools: forced calls valid for
their schemas, the OpenAI stream format of `delta.tool_calls`, and a round trip call -> tool
result -> answer, streaming and not."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.chat_templates import HERMES_TOOLS_TEMPLATE
from tests.entrypoints.server_utils import ServerProcess

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMETERS},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 10}},
                "required": ["zone"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
EXTRA = {"chat_template": HERMES_TOOLS_TEMPLATE}


def assert_valid_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_yields_valid_calls(client: openai.OpenAI, server: ServerProcess) -> None:
    response = client.chat.completions.create(
        model=server.model_name,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        n=2,
        temperature=1.0,
        seed=11,
        max_tokens=64,
        extra_body=EXTRA,
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert_valid_call(call)


def test_named_function(client: openai.OpenAI, server: ServerProcess) -> None:
    response = client.chat.completions.create(
        model=server.model_name,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=48,
        temperature=0,
        extra_body=EXTRA,
    )
    [call] = response.choices[0].message.tool_calls or []
    assert call.function.name == "get_time"
    assert_valid_call(call)


def collect_stream(stream: Any) -> tuple[str, list[dict], str | None, list]:
    """The content, the tool calls assembled from their deltas, the finish reason, the deltas."""
    content, calls, finish_reason, deltas = "", [], None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            deltas.append(delta)
            if delta.id is not None:
                assert delta.index == len(calls) and delta.type == "function" and delta.function.name
                calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    return content, calls, finish_reason, deltas


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip(client: openai.OpenAI, server: ServerProcess, stream: bool) -> None:
    """The model calls a tool; its result goes back through the template; the model answers."""
    kwargs: dict[str, Any] = dict(model=server.model_name, tools=TOOLS, max_tokens=40, temperature=0, extra_body=EXTRA)
    if stream:
        _, calls, finish_reason, deltas = collect_stream(
            client.chat.completions.create(messages=QUESTION, tool_choice="required", stream=True, **kwargs)
        )
        assert finish_reason == "tool_calls" and len(deltas) > 2  # arguments arrive in pieces
        name, arguments, call_id = calls[0]["name"], calls[0]["arguments"], calls[0]["id"]
    else:
        response = client.chat.completions.create(messages=QUESTION, tool_choice="required", **kwargs)
        call = (response.choices[0].message.tool_calls or [])[0]
        name, arguments, call_id = call.function.name, call.function.arguments, call.id
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    result = {"temperature": 21, "sky": "clear"}
    conversation = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)},
    ]
    rendered = httpx.post(
        f"{server.url}/tokenize",
        json={
            "messages": conversation,
            "tools": TOOLS,
            "chat_template": HERMES_TOOLS_TEMPLATE,
            "return_token_strs": False,
        },
        timeout=30,
    ).json()
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": rendered["tokens"]}, timeout=30).json()["prompt"]
    assert "<tool_response>\n" + json.dumps(result) in text and f'"name": "{name}", "arguments": ' in text
    kwargs["max_tokens"] = 12
    if stream:
        content, calls, finish_reason, _ = collect_stream(
            client.chat.completions.create(messages=conversation, tool_choice="auto", stream=True, **kwargs)
        )
    else:
        answer = client.chat.completions.create(messages=conversation, tool_choice="auto", **kwargs).choices[0]
        content, calls, finish_reason = (
            answer.message.content or "",
            answer.message.tool_calls or [],
            answer.finish_reason,
        )
    # The demo model answers in words (a call would be read as one, with finish_reason tool_calls).
    assert (content and not calls and finish_reason in ("stop", "length")) or (calls and finish_reason == "tool_calls")


def test_auto_parses_the_models_own_calls(client: openai.OpenAI, server: ServerProcess) -> None:
    """A Hermes call the model writes itself (forced here by a regex, as no small model can be
    relied on to call) comes back as a tool call, not as content."""
    written = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    for stream in (False, True):
        request = client.chat.completions.create(
            model=server.model_name,
            messages=QUESTION,
            tools=TOOLS[1:],
            # Room to spare: under a regex the model may spell the call in more, shorter tokens
            # than the tokenizer would (how many depends on its logits, so on the machine).
            max_tokens=160,
            temperature=0,
            stream=stream,
            extra_body={**EXTRA, "guided_regex": "Let me check\\.\n" + _escape(written)},
        )
        if stream:
            content, calls, finish_reason, _ = collect_stream(request)
            arguments = calls[0]["arguments"]
        else:
            message = request.choices[0].message
            content, finish_reason, arguments = (
                message.content,
                request.choices[0].finish_reason,
                message.tool_calls[0].function.arguments,
            )
        assert (
            content == "Let me check.\n" and finish_reason == "tool_calls" and json.loads(arguments) == {"zone": "UTC"}
        )


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_bad_tool_requests(server: ServerProcess) -> None:
    for body, message in [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ]:
        response = httpx.post(
            f"{server.url}/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4, **body}, timeout=30
        )
        assert response.status_code == 400 and message in response.json()["error"]["message"]
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "tools": TOOLS}, timeout=30)
    assert response.status_code == 400
