"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}`, for every failure.

Status codes: 400 bad values (also request-validation errors from pydantic: wrong JSON types,
missing fields, malformed JSON, as OpenAI answers them; never 422), 401 bad or missing API key,
404 unknown model or route, 405 wrong method (with Starlette's `Allow` header), 413 body too
large, 429 too many requests waiting (with `Retry-After`), 500 a bug, 503 the engine is dead or
a request ran past `--request-timeout` (with `Retry-After`). A `ValueError` from shoal's
frontend (bad sampling values, a bad prompt) is a 400.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from shoal.errors import EngineDeadError, RequestUnavailableError

logger = logging.getLogger(__name__)

# "SamplingParams.top_p must be ..." names the field a client got wrong.
_PARAM_IN_MESSAGE = re.compile(r"^SamplingParams\.(\w+) ")


class APIError(Exception):
    """An error answered to the client with its HTTP status and an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.info).model_dump()

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_value_error(exc: ValueError) -> APIError:
    message = str(exc)
    match = _PARAM_IN_MESSAGE.match(message)
    return bad_request(message, param=match.group(1) if match else None)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def engine_dead() -> APIError:
    return APIError(
        503, "The engine is dead; this server cannot generate any more.", "server_error", code="engine_dead"
    )


def unauthorized() -> APIError:
    return APIError(401, "Missing or incorrect API key.", code="invalid_api_key")


def body_too_large(limit_bytes: int) -> APIError:
    message = f"The request body is larger than the limit of {limit_bytes} bytes."
    return APIError(413, message, code="request_too_large")


def too_many_waiting(limit: int, retry_after_s: float) -> APIError:
    """429, as OpenAI answers a rate limit: the client may retry after `Retry-After` seconds."""
    message = f"The server has {limit} requests waiting already (--max-num-waiting-requests); retry later."
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    return APIError(429, message, "rate_limit_error", code="too_many_waiting_requests", headers=headers)


def request_timed_out(timeout_s: float, retry_after_s: float) -> APIError:
    """503: the server could not finish the request within `--request-timeout` (it was aborted)."""
    message = f"The request did not finish within the server's request timeout of {timeout_s:g} s; it was aborted."
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    return APIError(503, message, "server_error", code="request_timeout", headers=headers)


def to_api_error(exc: BaseException) -> APIError:
    """The client-facing error for any exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_dead()
    if isinstance(exc, RequestUnavailableError):
        return APIError(503, str(exc), "server_error", code="engine_unavailable", headers={"Retry-After": "1"})
    if isinstance(exc, ValueError):
        return from_value_error(exc)
    logger.exception("Unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}", "server_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One line listing every validation error, and the first bad field's name."""
    parts, params = [], []
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ()) if part != "body"]
        if error.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}")
            continue
        if not loc and error.get("type") in ("model_attributes_type", "dict_type", "missing"):
            parts.append(_not_an_object(error.get("input")))
            continue
        field, message = ".".join(loc), str(error.get("msg")).removeprefix("Value error, ")
        if field:
            params.append(field)
        parts.append(f"{field}: {message}" if field else message)
    return "; ".join(parts) or "invalid request", params[0] if params else None


def _not_an_object(body: Any) -> str:
    """What is wrong with a body that is not a JSON object: FastAPI parses a body as JSON only
    under a JSON Content-Type and hands any other body over as bytes."""
    if body is None:  # no body, or JSON null
        return "the body must be a JSON object; this request has none"
    if isinstance(body, (bytes, bytearray)):
        return "the body must be a JSON object, sent with Content-Type: application/json"
    kinds = {list: "an array", str: "a string", bool: "a boolean"}
    return f"the body must be a JSON object, not {kinds.get(type(body), 'a number')}"


def validation_failed(exc: RequestValidationError) -> APIError:
    """The 400 for a body that does not parse (pydantic's errors, in one line)."""
    return bad_request(*_validation_message(exc))


def install_exception_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).to_response()

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_failed(exc).to_response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"Not found: {request.method} {request.url.path}"
        else:
            message = str(exc.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        # Starlette's headers (a 405's `Allow`) stay on the answer.
        return APIError(exc.status_code, message, code=code, headers=exc.headers).to_response()

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    for exc_type in (APIError, EngineDeadError, RequestUnavailableError, ValueError, Exception):
        app.add_exception_handler(exc_type, on_api_error)
