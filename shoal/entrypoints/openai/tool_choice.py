"""What a chat request's `tools` and `tool_choice` ask of the engine: which parser reads the
output, and for "required" or a named function the structured-output constraint that makes
the model call (with arguments valid for the function's schema).

- no tools, or "none": no parsing (the tools are still rendered by the chat template);
- "auto" (the default with tools): the server's `--tool-call-parser` reads the model's own
  format (the server must be started with `--enable-auto-tool-choice`, as vLLM's);
- "required": the output is `[{"name": ..., "parameters": {...}}, ...]`, each element one of
  the tools with its parameters' schema (one element when `parallel_tool_calls` is false);
- `{"type": "function", "function": {"name": ...}}`: the output is that function's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from shoal.entrypoints.openai.tool_parsers.forced import NamedToolCallParser, RequiredToolCallsParser
from shoal.structured_output.params import StructuredOutputsParams

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    parser: ToolParser | None  # None: the output is not read for tool calls
    constraint: StructuredOutputsParams | None  # forces the calls (required, named)


NO_TOOLS = ToolPlan(parser=None, constraint=None)


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool,
    tool_call_parser: str | None,
    auto_tool_choice: bool,
) -> ToolPlan:
    """Raises `ValueError` (an HTTP 400) for a malformed tool, an unknown choice, or "auto"
    on a server without a tool-call parser."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return NO_TOOLS
    functions = {_function(tool)["name"]: _function(tool) for tool in tools}
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return NO_TOOLS
    if choice == "auto":
        if tool_call_parser is None or not auto_tool_choice:
            raise ValueError(
                'tool_choice "auto" needs a server started with --enable-auto-tool-choice and --tool-call-parser'
            )
        return ToolPlan(parser=get_tool_parser(tool_call_parser), constraint=None)
    if choice == "required":
        schema = required_calls_schema(list(functions.values()), parallel_tool_calls)
        return ToolPlan(parser=RequiredToolCallsParser(), constraint=StructuredOutputsParams(json=schema))
    name = _named_choice(choice)
    if name not in functions:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
    parameters = functions[name].get("parameters") or _ANY_OBJECT
    return ToolPlan(parser=NamedToolCallParser(name), constraint=StructuredOutputsParams(json=parameters))


def _function(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ValueError('every tool must be {"type": "function", "function": {"name": ..., "parameters": ...}}')
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError("every tool's function needs a name")
    if not isinstance(function.get("parameters", {}), dict):
        raise ValueError(f"the parameters of tool {function['name']!r} must be a JSON schema object")
    return function


def _named_choice(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )
    return function["name"]


def required_calls_schema(functions: list[dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    """A JSON array of one or more calls, each {"name": <a tool's name>, "parameters": <its
    arguments>}; the name comes first, so a stream can announce the call before its arguments.

    A `$ref` is resolved from the root of the schema it is in, so each tool's definitions
    (`$defs`, or the older `definitions`) move to the root of the combined schema, renamed where
    two tools use one name, and its references are rewritten to match."""
    root_defs: dict[str, Any] = {}
    calls = []
    for f in functions:
        parameters = _hoisted(f["name"], f.get("parameters") or _ANY_OBJECT, root_defs)
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if root_defs:
        schema["$defs"] = root_defs
    return schema


_DEFINITIONS_KEYS = ("$defs", "definitions")


def _hoisted(tool_name: str, parameters: dict[str, Any], root_defs: dict[str, Any]) -> dict[str, Any]:
    """`parameters` without its definitions, which join `root_defs` under names not yet taken
    there; its `$ref`s (and its definitions' own) now point into the combined schema (a
    reference into the parameters themselves, to a copy of them named after the tool)."""
    local = {key: parameters.get(key) for key in _DEFINITIONS_KEYS if isinstance(parameters.get(key), dict)}
    body = {key: value for key, value in parameters.items() if key not in local}
    renamed: dict[tuple[str, str], str] = {}
    for key, definitions in local.items():
        for name in definitions:
            renamed[key, name] = _free_name(name, root_defs)
            root_defs[renamed[key, name]] = None  # taken
    whole = _free_name(tool_name, root_defs)
    needs_whole = False

    def pointer(ref: str) -> str:
        nonlocal needs_whole
        segments = [_unescape(s) for s in ref[1:].split("/")[1:]] if ref.startswith("#/") else []
        if len(segments) >= 2 and (segments[0], segments[1]) in renamed:
            return _ref([renamed[segments[0], segments[1]], *segments[2:]])
        needs_whole = True  # "#" (a recursive schema) or a path into its properties
        return _ref([whole, *segments])

    for key, definitions in local.items():
        for name, definition in definitions.items():
            root_defs[renamed[key, name]] = _with_refs(definition, pointer)
    body = _with_refs(body, pointer)
    if needs_whole:
        root_defs[whole] = body
    return body


def _free_name(name: str, taken: dict[str, Any]) -> str:
    candidate, number = name, 1
    while candidate in taken:
        number += 1
        candidate = f"{name}_{number}"
    return candidate


def _with_refs(node: Any, pointer: Any) -> Any:
    """`node` with every local `$ref` ("#...") replaced by `pointer(ref)`."""
    if isinstance(node, list):
        return [_with_refs(item, pointer) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _with_refs(value, pointer) for key, value in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = pointer(ref)
    return out


def _unescape(segment: str) -> str:
    """One JSON-pointer segment (RFC 6901: `~1` is "/", `~0` is "~")."""
    return segment.replace("~1", "/").replace("~0", "~")


def _ref(segments: list[str]) -> str:
    escaped = (s.replace("~", "~0").replace("/", "~1") for s in segments)
    return "#/$defs/" + "/".join(escaped)
