"""What agent libraries send and get back on a tool round trip, on the session's demo-model
server through the official `openai` client: the assistant's tool-call message with null or
absent content (rendered by the model's own template, which concatenates `content`), tool
results, content parts, tool schemas with `$defs` / `$ref` (any Pydantic model with a nested
model) under `tool_choice: "required"`, and forced calls cut off by `max_tokens`."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.entrypoints.chat_templates import HERMES_TOOLS_TEMPLATE
from tests.entrypoints.server_utils import ServerProcess

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL: Any = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMETERS},
}
QUESTION: Any = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CALL: Any = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
RESULT: Any = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}


@pytest.mark.parametrize(
    "assistant",
    [
        {"role": "assistant", "content": None, "tool_calls": [CALL]},  # what OpenAI documents, LangChain sends
        {"role": "assistant", "tool_calls": [CALL]},  # what openai-agents sends
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
    ],
    ids=["null", "absent", "empty"],
)
def test_the_second_turn_renders_with_the_models_own_template(
    client: openai.OpenAI, server: ServerProcess, assistant: dict
) -> None:
    """The demo model's template writes `message['content']` for every role: a tool-call
    message without content must not stop the conversation."""
    response = client.chat.completions.create(
        model=server.model_name,
        messages=[*QUESTION, assistant, RESULT],
        tools=[WEATHER_TOOL],
        max_tokens=4,
        temperature=0,
    )
    assert response.choices[0].message.content and response.choices[0].finish_reason in ("stop", "length")


def rendered(server: ServerProcess, messages: list, **body: Any) -> str:
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **body}, timeout=30).json()["tokens"]
    return httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]


def test_null_content_and_content_parts_render_as_text(server: ServerProcess) -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {**RESULT, "content": [{"type": "text", "text": '{"temperature": 21}'}]},
    ]
    text = rendered(server, messages)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text and "Weather\nin Paris?" in text
    assert "<|im_start|>assistant\n<|im_end|>" in text and '<|im_start|>tool\n{"temperature": 21}' in text


def test_tool_call_arguments_reach_the_template_as_an_object(server: ServerProcess) -> None:
    """JSON-text arguments become an object (templates write them with `tojson`); arguments
    that are not a JSON object stay the text they were."""
    odd = {**CALL, "function": {"name": "get_weather", "arguments": "Paris, please"}}
    messages = [*QUESTION, {"role": "assistant", "tool_calls": [CALL, odd]}, RESULT]
    text = rendered(server, messages, tools=[WEATHER_TOOL], chat_template=HERMES_TOOLS_TEMPLATE)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '{"name": "get_weather", "arguments": "Paris, please"}' in text


class Address(BaseModel):
    # Bounded strings: a small model fills an unbounded one without end.
    city: str = Field(max_length=12)
    country: str = Field(max_length=12)


class Trip(BaseModel):
    """A nested model: Pydantic writes `Address` under `$defs` and refers to it with `$ref`."""

    start: Address
    stops: list[Address] = Field(max_length=1)


class Parcel(BaseModel):
    # Another `Address`, of another shape: the two tools' definitions share a name.
    class Address(BaseModel):
        zip_code: int = Field(ge=0, le=99999)

    to: Address


def nested_tools() -> list[Any]:
    return [
        {"type": "function", "function": {"name": "plan_trip", "parameters": Trip.model_json_schema()}},
        {"type": "function", "function": {"name": "send_parcel", "parameters": Parcel.model_json_schema()}},
    ]


def test_required_with_nested_schemas(client: openai.OpenAI, server: ServerProcess) -> None:
    """The combined schema of "required" resolves each tool's references (the two `Address`
    definitions kept apart); each call validates against its own tool's schema."""
    tools = nested_tools()
    assert all("$defs" in t["function"]["parameters"] for t in tools)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for choice in ({"type": "function", "function": {"name": "send_parcel"}}, "required"):
        response = client.chat.completions.create(
            model=server.model_name,
            messages=QUESTION,
            tools=tools,
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,  # the demo model repeats calls until max_tokens otherwise
            max_tokens=100,
            temperature=0,
        )
        assert response.choices[0].finish_reason == "tool_calls", response.choices[0]
        for call in response.choices[0].message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [1, 2, 4])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_cut_by_max_tokens_is_no_content(
    client: openai.OpenAI, server: ServerProcess, choice: str, max_tokens: int, stream: bool
) -> None:
    """The JSON fragment a forced call was cut at (`[`, `{"city":`) is no answer: no content,
    no tool calls, `finish_reason: "length"`. (A stream has sent the call's name and the
    arguments written so far, as OpenAI's do, and then ends with "length".)"""
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kwargs: Any = dict(
        model=server.model_name,
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        max_tokens=max_tokens,
        temperature=0,
    )
    if not stream:
        choice_out = client.chat.completions.create(**kwargs).choices[0]
        assert (choice_out.message.content or "") == "" and not choice_out.message.tool_calls
        assert choice_out.finish_reason == "length"
        return
    content, finish_reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            finish_reason = chunk.choices[0].finish_reason or finish_reason
    assert content == "" and finish_reason == "length"
