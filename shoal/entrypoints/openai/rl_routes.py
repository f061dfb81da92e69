"""HTTP routes for RL rollouts, present only with `shoal serve --enable-rl-endpoints` (behind
`--api-key` like every other route): sleep / wake_up and pause / resume of the engine.

    POST /sleep?level=1                      free the engine's GPU memory (level 1 or 2)
    POST /wake_up[?tags=weights&tags=kv_cache]   restore all of it, or the parts named
    GET  /is_sleeping                        {"is_sleeping": bool}
    POST /pause?mode=abort&clear_cache=true  hold generation (mode abort | wait | keep)
    POST /resume                             generate again
    GET  /is_paused                          {"is_paused": bool}

Arguments come as query parameters (as vLLM's routes take them) or as a JSON object body (as
SGLang's do: {"level": 2}, {"tags": ["weights"]}, {"mode": "keep", "clear_cache": false}); a
bad value is a 400 with an OpenAI error body. `/pause` with mode=wait answers once the running
requests have finished. See docs/rl.md.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from shoal.entrypoints.openai.errors import bad_request, engine_dead

if TYPE_CHECKING:
    from shoal.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

router = APIRouter()

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _engine(request: Request) -> AsyncLLM:
    engine = request.app.state.shoal.engine
    if engine.errored:
        raise engine_dead()
    return engine


async def _arguments(request: Request) -> dict[str, Any]:
    """The call's arguments: the JSON body's fields, then the query parameters (repeated ones,
    like tags, as lists)."""
    arguments: dict[str, Any] = {}
    body = await request.body()
    if body.strip():
        try:
            arguments = json.loads(body)
        except ValueError as exc:
            raise bad_request(f"the body is not valid JSON: {exc}") from exc
        if not isinstance(arguments, dict):
            raise bad_request("the body must be a JSON object")
    for key in request.query_params:
        values = request.query_params.getlist(key)
        arguments[key] = values if key == "tags" else values[-1]
    return arguments


def _int(arguments: dict[str, Any], name: str, default: int) -> int:
    value = arguments.get(name, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise bad_request(f"{name} must be an integer, got {value!r}", name) from None


def _bool(arguments: dict[str, Any], name: str, default: bool) -> bool:
    value = arguments.get(name, default)
    if isinstance(value, bool):
        return value
    if str(value).lower() in _TRUE + _FALSE:
        return str(value).lower() in _TRUE
    raise bad_request(f"{name} must be true or false, got {value!r}", name)


def _tags(arguments: dict[str, Any]) -> list[str] | None:
    tags = arguments.get("tags")
    if tags is None:
        return None
    if isinstance(tags, str):
        tags = [tags]
    if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
        raise bad_request("tags must be a list of strings", "tags")
    # ?tags=weights,kv_cache as well as ?tags=weights&tags=kv_cache
    return [tag for value in tags for tag in value.split(",") if tag]


@router.post("/sleep")
async def sleep(request: Request) -> dict[str, bool]:
    engine = _engine(request)
    await engine.sleep(_int(await _arguments(request), "level", 1))
    return {"is_sleeping": True}


@router.post("/wake_up")
async def wake_up(request: Request) -> dict[str, bool]:
    engine = _engine(request)
    await engine.wake_up(_tags(await _arguments(request)))
    return {"is_sleeping": await engine.is_sleeping()}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, bool]:
    return {"is_sleeping": await _engine(request).is_sleeping()}


@router.post("/pause")
async def pause(request: Request) -> dict[str, bool]:
    engine = _engine(request)
    arguments = await _arguments(request)
    mode = arguments.get("mode", "abort")
    await engine.pause_generation(str(mode), _bool(arguments, "clear_cache", True))
    return {"is_paused": True}


@router.post("/resume")
async def resume(request: Request) -> dict[str, bool]:
    engine = _engine(request)
    await engine.resume_generation()
    return {"is_paused": False}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, bool]:
    return {"is_paused": await _engine(request).is_paused()}
