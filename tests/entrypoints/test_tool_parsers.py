"""Tool-call parsers on text: each family's format read into calls, content kept around them,
and a stream cut anywhere giving deltas that add up to the final calls."""

from __future__ import annotations

import json

import pytest

from shoal.entrypoints.openai.tool_choice import plan_tools, required_calls_schema
from shoal.entrypoints.openai.tool_parsers import ToolCallStreamer, ToolParser, get_tool_parser
from shoal.entrypoints.openai.tool_parsers.forced import NamedToolCallParser, RequiredToolCallsParser
from shoal.entrypoints.openai.tool_parsers.json_scan import object_members, value_end

WEATHER = {"city": "Paris", "unit": "celsius", "days": [1, 2], "note": 'say "hi" {ok}'}
TIME = {"zone": "UTC+1"}

CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        + json.dumps(TIME)
        + "}\n</tool_call>",
        "Let me check.\n",
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": '
        + json.dumps(WEATHER)
        + '}; {"name": "get_time", "parameters": '
        + json.dumps(TIME)
        + "}",
        None,
    ),
    (
        "mistral",
        'Sure [TOOL_CALLS] [{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}, {"name": "get_time", "arguments": '
        + json.dumps(TIME)
        + "}]",
        "Sure ",
    ),
    (
        "mistral",
        "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER) + "[TOOL_CALLS]get_time[ARGS]" + json.dumps(TIME),
        None,
    ),
    (
        "deepseek_v3",
        "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        + json.dumps(WEATHER)
        + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
        + json.dumps(TIME)
        + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Let me check.",
    ),
    (
        "deepseek_v31",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        + json.dumps(WEATHER)
        + "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
        + json.dumps(TIME)
        + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        None,
    ),
]


@pytest.mark.parametrize(("name", "text", "content"), CASES)
def test_final_calls(name: str, text: str, content: str | None) -> None:
    parsed_content, calls = get_tool_parser(name).tool_calls(text)
    assert parsed_content == content
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.function.arguments) for c in calls] == [WEATHER, TIME]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize(("name", "text", "content"), CASES)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_stream_adds_up_to_the_final_calls(name: str, text: str, content: str | None, step: int) -> None:
    streamed_content, calls = _stream(get_tool_parser(name), text, step)
    assert streamed_content == (content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", WEATHER), ("get_time", TIME)]


def _stream(parser: ToolParser, text: str, step: int) -> tuple[str, list[dict]]:
    """Feed `text` `step` characters at a time; the content and calls the deltas add up to."""
    streamer = ToolCallStreamer(parser)
    content, calls = "", []
    for end in [*range(step, len(text), step), len(text)]:
        new_content, deltas = streamer.update(text[:end], final=end == len(text))
        content += new_content
        for delta in deltas:
            if delta.id is not None:
                assert delta.index == len(calls) and delta.type == "function"
                calls.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    return content, calls


def test_plain_answers_are_content() -> None:
    for name in ("hermes", "llama3_json", "mistral", "deepseek_v3"):
        assert get_tool_parser(name).tool_calls("The weather is fine.") == ("The weather is fine.", [])


def test_a_stream_holds_back_what_may_be_a_marker() -> None:
    streamer = ToolCallStreamer(get_tool_parser("hermes"))
    assert streamer.update("Hello <tool_", final=False) == ("Hello ", [])
    assert streamer.update("Hello <tool_x", final=False) == ("<tool_x", [])
    llama = ToolCallStreamer(get_tool_parser("llama3_json"))
    assert llama.update("  <|python", final=False) == ("", [])


def test_a_call_cut_off_is_content() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert get_tool_parser("hermes").tool_calls(text) == (text, [])


def test_a_forced_call_cut_off_is_nothing() -> None:
    """A forced output is a call or a fragment of one, never an answer in words."""
    for text in ("[", '[{"name": "get_weather", "parameters": {"city":', '[{"name": "get_wea'):
        assert RequiredToolCallsParser().tool_calls(text) == (None, [])
    for text in ("{", '{"zone":', '{"zone": "UT'):
        assert NamedToolCallParser("get_time").tool_calls(text) == (None, [])


def test_forced_parsers() -> None:
    required = RequiredToolCallsParser()
    text = json.dumps([{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": TIME}])
    _, calls = required.tool_calls(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", WEATHER),
        ("get_time", TIME),
    ]
    _, streamed = _stream(required, text, 2)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [("get_weather", WEATHER), ("get_time", TIME)]
    content, calls = NamedToolCallParser("get_time").tool_calls(json.dumps(TIME))
    assert content is None and calls[0].function.name == "get_time" and json.loads(calls[0].function.arguments) == TIME


def test_json_scan_on_partial_text() -> None:
    text = '{"name": "f", "arguments": {"a": [1, "}"], "b": 2'
    members, end = object_members(text, 0)
    assert end is None
    assert [(m.key, m.value_end is not None) for m in members] == [("name", True), ("arguments", False)]
    assert members[1].raw(text) == '{"a": [1, "}"], "b": 2'
    assert value_end("123", 0) is None and value_end("123,", 0) == 3 and value_end('"a\\"b"x', 0) == 6


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def test_tool_plans() -> None:
    assert plan_tools(TOOLS, "none", True, None, False).parser is None
    auto = plan_tools(TOOLS, None, True, "hermes", True)
    assert auto.parser is not None and auto.parser.name == "hermes" and auto.constraint is None
    required = plan_tools(TOOLS, "required", False, None, False)
    assert required.constraint is not None and json.loads(required.constraint.json) == required_calls_schema(
        [t["function"] for t in TOOLS], parallel_tool_calls=False
    )
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True, None, False)
    assert named.constraint is not None and json.loads(named.constraint.json) == {"type": "object"}


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        (TOOLS, "auto", "--enable-auto-tool-choice"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
        (TOOLS, "sometimes", "tool_choice must be"),
        (None, "required", "tool_choice needs tools"),
        ([{"type": "function", "function": {}}], "required", "needs a name"),
    ],
)
def test_bad_tool_requests(tools: list | None, choice: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_tools(tools, choice, True, None, False)  # type: ignore[arg-type]


def test_required_schema_hoists_each_tools_definitions() -> None:
    """Each tool's `$defs` move to the root (a `$ref` resolves from there), a name two tools
    use is kept apart, and references into a tool's own schema ("#", "#/properties/...") still
    point at it."""
    import jsonschema

    from shoal.structured_output.grammar import validate
    from shoal.structured_output.params import StructuredOutputsParams

    def address(field: str, kind: str) -> dict:
        return {"type": "object", "properties": {field: {"type": kind}}, "required": [field]}

    trip = {"$defs": {"Address": address("city", "string")}, "properties": {"to": {"$ref": "#/$defs/Address"}}}
    parcel = {
        "definitions": {"Address": address("zip", "integer")},
        "properties": {"to": {"$ref": "#/definitions/Address"}},
    }
    tree = {"properties": {"size": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}}}
    same = {"properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}}}
    tools = [{"name": "trip", "parameters": trip}, {"name": "parcel", "parameters": parcel}]
    schema = required_calls_schema(
        [*tools, {"name": "tree", "parameters": tree}, {"name": "same", "parameters": same}], True
    )
    assert set(schema["$defs"]) == {"Address", "Address_2", "tree", "same"}
    validate(StructuredOutputsParams(json=schema))  # xgrammar resolves every reference
    good = [
        {"name": "trip", "parameters": {"to": {"city": "Paris"}}},
        {"name": "parcel", "parameters": {"to": {"zip": 75001}}},
        {"name": "tree", "parameters": {"size": 1, "kids": [{"size": 2, "kids": []}]}},
        {"name": "same", "parameters": {"a": 1, "b": 2}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        {"name": "parcel", "parameters": {"to": {"zip": "75001"}}},
        {"name": "tree", "parameters": {"kids": [{"size": "big"}]}},
        {"name": "same", "parameters": {"a": 1, "b": "two"}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], schema)
    assert trip["properties"] == {"to": {"$ref": "#/$defs/Address"}}  # the request's tools are left as they came
