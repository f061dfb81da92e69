"""HTTP routes for RL rollouts, present only with `shoal serve --enable-rl-endpoints` (behind
`--api-key` like every other route): one route per `Route` of the RL verbs declared in
shoal/rl_verbs.py (sleep / wake_up, pause / resume, weight updates; docs/rl.md lists them).

A route's fields are its verb's parameters. They come as query parameters (as vLLM's routes
take them; a list repeated, `?tags=weights&tags=kv_cache`, or comma-separated) or as a JSON
object body (as SGLang's do: {"level": 2}, {"tags": ["weights"]}), and are read by their
declared type; a missing or bad value is a 400 with an OpenAI error body, as is the engine's
ValueError. The route calls the `AsyncLLM` method of the verb and answers the route's `answer`.
A route's `rewrite` turns another framework's fields into the verb's first
(shoal/entrypoints/openai/rl_spellings.py), and a true `abort_all_requests` field (SGLang's)
aborts every request before the call.

The native APIs beside them (SGLang's /generate, vLLM's weight transfer and token-in/token-out
generate) are in sglang_api.py and vllm_api.py; `rl_router` includes them.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from shoal import rl_verbs
from shoal.entrypoints.openai.errors import bad_request, engine_dead
from shoal.entrypoints.openai.native_requests import abort_all
from shoal.rl_verbs import RESULT, Query, Route, Verb

if TYPE_CHECKING:
    from shoal.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def rl_router() -> APIRouter:
    """The routes of every RL verb declared now, and SGLang's and vLLM's native RL APIs."""
    from shoal.entrypoints.openai import sglang_api, vllm_api

    router = APIRouter()
    for verb in rl_verbs.declared():
        for route in verb.routes:
            router.add_api_route(route.path, _endpoint(verb, route), methods=[route.method], name=verb.name)
    router.include_router(sglang_api.router)
    router.include_router(vllm_api.router)
    return router


def _endpoint(verb: Verb, route: Route) -> Callable[[Request], Awaitable[dict[str, Any]]]:
    parameters = list(verb.signature.parameters.values())
    readers = {p.name: _reader(verb, p.annotation) for p in parameters}
    list_fields = {name for name, reader in readers.items() if reader in _LIST_READERS}
    rewrite = _function(route.rewrite) if route.rewrite else None

    async def endpoint(request: Request) -> dict[str, Any]:
        engine = _engine(request)
        fields = await _fields(request, route, list_fields, rewrite)
        arguments = {p.name: _argument(p, fields, route, readers[p.name]) for p in parameters}
        if _bool("abort_all_requests", fields.get("abort_all_requests", False)):
            await abort_all(engine)
        result = await getattr(engine, verb.name)(**arguments)
        return await _answer(engine, route.answer, result)

    endpoint.__name__ = verb.name
    return endpoint


def _argument(
    parameter: inspect.Parameter, fields: dict[str, Any], route: Route, reader: Callable[[str, Any], Any]
) -> Any:
    """The field read as its parameter's type; absent (or null): the route's default, else the
    signature's, else a 400."""
    value = fields.get(parameter.name)
    if value is not None:
        return reader(parameter.name, value)
    default = route.defaults.get(parameter.name, parameter.default)
    if default is parameter.empty:
        raise bad_request(f"{parameter.name} is required", parameter.name)
    return default


def _engine(request: Request) -> AsyncLLM:
    engine = request.app.state.shoal.engine
    if engine.errored:
        raise engine_dead()
    return engine


def _function(path: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


async def _fields(
    request: Request,
    route: Route,
    list_fields: set[str],
    rewrite: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The call's fields: the JSON body's, then the query parameters (a list field's values
    repeated or comma-separated), rewritten (`route.rewrite`), each under its parameter's name
    (`route.aliases`)."""
    fields: dict[str, Any] = {}
    body = await request.body()
    if body.strip():
        try:
            fields = json.loads(body)
        except ValueError as exc:
            raise bad_request(f"the body is not valid JSON: {exc}") from exc
        if not isinstance(fields, dict):
            raise bad_request("the body must be a JSON object")
    for key in request.query_params:
        values = request.query_params.getlist(key)
        name = route.aliases.get(key, key)
        fields[key] = (
            [part for value in values for part in value.split(",") if part] if name in list_fields else values[-1]
        )
    if rewrite is not None:
        try:
            fields = rewrite(fields)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
    for alias, name in route.aliases.items():
        if alias in fields and fields.get(name) is None:
            fields[name] = fields.pop(alias)
    return fields


async def _answer(engine: AsyncLLM, template: Mapping[str, Any], result: Any) -> dict[str, Any]:
    answer = {}
    for key, value in template.items():
        if value is RESULT:
            value = result
        elif isinstance(value, Query):
            value = await getattr(engine, value.verb)()
        answer[key] = value
    return answer


# ---- reading a field as its parameter's declared type ------------------------------------------


def _int(name: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise bad_request(f"{name} must be an integer, got {value!r}", name) from None


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in _TRUE + _FALSE:
        return str(value).lower() in _TRUE
    raise bad_request(f"{name} must be true or false, got {value!r}", name)


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string, got {value!r}", name)
    return value


def _strings(name: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise bad_request(f"{name} must be a list of strings", name)
    return value


def _shapes(name: str, value: Any) -> list[list[int]]:
    if not isinstance(value, list) or not all(_is_shape(item) for item in value):
        raise bad_request(f"{name} must be a list of lists of integers", name)
    return value


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(size, int) and not isinstance(size, bool) for size in value)


def _as_is(name: str, value: Any) -> Any:
    return value


# By declared type; `X | None` reads as X (None, or no value, is the default).
_READERS: dict[Any, Callable[[str, Any], Any]] = {
    int: _int,
    bool: _bool,
    str: _str,
    list[str]: _strings,
    list[list[int]]: _shapes,
    Any: _as_is,
}
_LIST_READERS = (_strings, _shapes)


def _reader(verb: Verb, annotation: Any) -> Callable[[str, Any], Any]:
    """How a route reads a field of this type; a verb whose route could not read a parameter
    fails when the router is built."""
    args = getattr(annotation, "__args__", ())
    if type(None) in args and len(args) == 2:  # X | None
        annotation = next(arg for arg in args if arg is not type(None))
    reader = _READERS.get(annotation)
    if reader is None:
        raise TypeError(f"RL verb {verb.name!r}: a route cannot read a parameter of type {annotation!r}")
    return reader
