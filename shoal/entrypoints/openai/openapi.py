"""The OpenAPI schema `/openapi.json` serves, made exact: every route lists its error statuses
with the OpenAI error body (FastAPI's own 422 never happens here: validation errors are 400s),
the routes that answer text or server-sent events say so, and the bounds that depend on the
served model (token ids below its vocabulary size, `max_tokens` below its context) are filled
in from it (protocol.py marks those fields with `x-shoal-bound`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi.openapi.utils import get_openapi

from shoal.entrypoints.openai.protocol import ErrorResponse

if TYPE_CHECKING:
    from fastapi import FastAPI

    from shoal.config import ModelConfig

_ERROR_DESCRIPTIONS = {
    400: "A bad value, a malformed or too deeply nested body, or a request that does not fit the model",
    401: "A missing or wrong API key (only when the server has one)",
    404: "An unknown model",
    413: "The request body is larger than the server's limit",
    429: "Too many requests are waiting (`--max-num-waiting-requests`); retry after `Retry-After` seconds",
    503: "The engine is dead, or the request ran past `--request-timeout` (with `Retry-After`)",
}
# The errors each kind of route can answer.
GENERATE_ERRORS = (400, 401, 404, 413, 429, 503)
TOKENIZER_ERRORS = (400, 401, 404, 413)
READ_ERRORS = (401,)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` entries: each status with the OpenAI error body."""
    return {status: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]} for status in statuses}


def json_or_stream(model: type) -> dict[int | str, dict[str, Any]]:
    """A 200 that is `model` as JSON, or server-sent events with `"stream": true`."""
    # Before OpenAPI 3.2, an event stream's schema describes one event.
    event = {
        "type": "object",
        "properties": {"data": {"type": "string", "description": "a chunk's JSON; the last event's is [DONE]"}},
        "required": ["data"],
    }
    events = {"schema": event}
    return {200: {"model": model, "description": "The answer", "content": {"text/event-stream": events}}}


def install_openapi(app: FastAPI, model_config: ModelConfig) -> None:
    """Serve the exact schema of `app` for `model_config`'s model (built once, on first use)."""
    bounds = {"vocab": model_config.vocab_size - 1, "context": model_config.max_model_len - 1}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _drop_validation_error(schema)
            _fill_bounds(schema, bounds)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _drop_validation_error(schema: dict[str, Any]) -> None:
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def _fill_bounds(node: Any, bounds: dict[str, int]) -> None:
    """Replace the placeholder maximum of every `x-shoal-bound` integer with the model's."""
    if isinstance(node, dict):
        kind = node.pop("x-shoal-bound", None)
        if kind is not None:
            node["maximum"] = bounds[kind]
        for value in node.values():
            _fill_bounds(value, bounds)
    elif isinstance(node, list):
        for value in node:
            _fill_bounds(value, bounds)
