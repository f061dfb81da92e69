"""The request fields that become `SamplingParams.logit_bias` and `.structured_outputs`.

Structured output may be asked for four ways, at most one per request: OpenAI's
`response_format`, vLLM's `structured_outputs` object, and vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` fields. Each becomes one
`StructuredOutputsParams`; a bad value is a `ValueError` (an HTTP 400) naming the field.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from shoal.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from shoal.entrypoints.openai.protocol import SamplingRequest

_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def logit_bias_of(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys) with integer keys."""
    if not logit_bias:
        return None
    try:
        return {int(token_id): bias for token_id, bias in logit_bias.items()}
    except ValueError as exc:
        raise ValueError(f"SamplingParams.logit_bias keys must be token ids, got {list(logit_bias)}") from exc


def structured_outputs_of(request: SamplingRequest) -> StructuredOutputsParams | None:
    """The one structured-output constraint a request asks for, or None."""
    asked = [
        (name, convert(value))
        for name, value, convert in (
            ("response_format", request.response_format, _from_response_format),
            ("structured_outputs", request.structured_outputs, _from_structured_outputs),
            *((name, getattr(request, name), _guided(kind)) for name, kind in _GUIDED_FIELDS.items()),
        )
        if value is not None
    ]
    asked = [(name, params) for name, params in asked if params is not None]
    if len(asked) > 1:
        raise ValueError(f"give at most one structured-output field; got {', '.join(name for name, _ in asked)}")
    return asked[0][1] if asked else None


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, dict):
        raise ValueError("response_format.json_schema must be an object with a 'schema'")
    schema = json_schema.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema must be a JSON schema object")
    return StructuredOutputsParams(json=schema)


def _from_structured_outputs(fields: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(set(fields) - set(_STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise ValueError(
            f"structured_outputs has unknown keys {unknown}; it takes {', '.join(_STRUCTURED_OUTPUTS_KEYS)}"
        )
    given = {key: value for key, value in fields.items() if value is not None}
    _check_types(given)
    return StructuredOutputsParams(**given)


def _check_types(fields: dict[str, Any]) -> None:
    expected: dict[str, tuple[type, ...]] = {
        "json": (str, dict),
        "regex": (str,),
        "choice": (list,),
        "grammar": (str,),
        "json_object": (bool,),
        "disable_any_whitespace": (bool,),
    }
    for key, value in fields.items():
        if not isinstance(value, expected[key]):
            raise ValueError(f"structured_outputs.{key} has the wrong type: {type(value).__name__}")
    if isinstance(fields.get("json"), str):
        try:
            json.loads(fields["json"])
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json is not JSON: {exc}") from exc


def _guided(kind: str) -> Any:
    def convert(value: Any) -> StructuredOutputsParams:
        if kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"guided_json is not JSON: {exc}") from exc
        return StructuredOutputsParams(**{kind: value})

    return convert
