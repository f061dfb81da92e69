"""Random JSON schemas (nested objects, arrays, enums, required fields, bounded numbers) and a
valid instance of each, for the structured-output tests and `benchmarks/bench_grammar.py`.

Every part is bounded (string lengths, array sizes, integer and number ranges) so that even a
random model, sampling under the schema's grammar, finishes a document in a few hundred tokens.
"""

from __future__ import annotations

import random
import string
from typing import Any

_WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "north", "south", "yes", "no"]
_NAMES = ["id", "name", "count", "price", "tags", "items", "kind", "owner", "size", "level", "ok", "note"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema of 1-4 properties, some required, nested up to two levels."""
    names = rng.sample(_NAMES, rng.randint(1, 4))
    properties = {name: _random_property(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.6]
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _random_property(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        low = rng.choice([-10.0, 0.0, 0.5, 100.0])
        return {"type": "number", "minimum": low, "maximum": low + rng.choice([1.0, 10.0, 1000.0])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(2, 4))}
    if kind == "object":
        return random_schema(rng, depth + 1)
    low = rng.randint(0, 2)
    return {"type": "array", "items": _random_property(rng, depth + 1), "minItems": low, "maxItems": low + 2}


def random_instance(schema: dict[str, Any], rng: random.Random) -> Any:
    """A document that `schema` (from `random_schema`) accepts."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        required = set(schema.get("required", []))
        return {
            name: random_instance(sub, rng)
            for name, sub in schema["properties"].items()
            if name in required or rng.random() < 0.5
        }
    if kind == "array":
        size = rng.randint(schema["minItems"], schema["maxItems"])
        return [random_instance(schema["items"], rng) for _ in range(size)]
    if kind == "string":
        return "".join(rng.choice(string.ascii_letters + " ") for _ in range(rng.randint(0, schema["maxLength"])))
    if kind == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    if kind == "number":
        return round(rng.uniform(schema["minimum"], schema["maximum"]), 3)
    return rng.random() < 0.5
