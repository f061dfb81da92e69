"""What `shoal bench throughput --structured-output json-schema` puts on every request: a JSON
schema of the shape tool arguments and extraction tasks have (an array of objects with bounded
integers and numbers, bounded strings, enums, booleans, nested arrays), whose `minItems` no
request can reach, so that the grammar constrains every token and every request still generates
exactly its output length (as `ignore_eos` gives the unconstrained run)."""

from __future__ import annotations

from typing import Any

STRUCTURED_OUTPUT_MODES = ("none", "json-schema", "both")

BENCH_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 100_000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
            "name": {"type": "string", "maxLength": 24},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "other"]}, "maxItems": 3},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "score", "tags", "active"],
        "additionalProperties": False,
    },
}


def bench_structured_outputs() -> Any:
    from shoal.structured_output.params import StructuredOutputsParams

    return StructuredOutputsParams(json=BENCH_SCHEMA)
