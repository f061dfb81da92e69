"""HTTP routes for RL rollouts, present only with `shoal serve --enable-rl-endpoints` (behind
`--api-key` like every other route): sleep / wake_up, pause / resume and weight updates.

    POST /sleep?level=1                      free the engine's GPU memory (level 1 or 2)
    POST /wake_up[?tags=weights&tags=kv_cache]   restore all of it, or the parts named
    GET  /is_sleeping                        {"is_sleeping": bool}
    POST /pause?mode=abort&clear_cache=true  hold generation (mode abort | wait | keep)
    POST /resume                             generate again
    GET  /is_paused                          {"is_paused": bool}
    POST /init_weight_update_group           join a trainer's group {master_address, master_port,
                                             rank_offset, world_size, backend}
    POST /update_weights_from_distributed    receive its broadcast {names, dtypes, shapes,
                                             weight_version, reset_prefix_cache, bucket_bytes}
    POST /update_weights_from_disk           load a safetensors folder {path (or model_path), ...}
    POST /destroy_weight_update_group        leave the group
    GET  /weight_version                     {"weight_version": str}

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


# ---- weight updates ---------------------------------------------------------------------------


def _required(arguments: dict[str, Any], name: str) -> Any:
    if arguments.get(name) is None:
        raise bad_request(f"{name} is required", name)
    return arguments[name]


def _optional_str(arguments: dict[str, Any], name: str) -> str | None:
    value = arguments.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{name} must be a string, got {value!r}", name)
    return value


def _list_of(arguments: dict[str, Any], name: str, check: Any, what: str) -> list:
    value = _required(arguments, name)
    if not isinstance(value, list) or not all(check(item) for item in value):
        raise bad_request(f"{name} must be a list of {what}", name)
    return value


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(size, int) and not isinstance(size, bool) for size in value)


@router.post("/init_weight_update_group")
async def init_weight_update_group(request: Request) -> dict[str, bool]:
    engine = _engine(request)
    arguments = await _arguments(request)
    await engine.init_weight_update_group(
        str(_required(arguments, "master_address")),
        _int(arguments, "master_port", _required(arguments, "master_port")),
        _int(arguments, "rank_offset", 1),
        _int(arguments, "world_size", _required(arguments, "world_size")),
        _optional_str(arguments, "backend"),
    )
    return {"success": True}


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> dict[str, Any]:
    """Answers once every bucket of the trainer's broadcast has been received and loaded."""
    engine = _engine(request)
    arguments = await _arguments(request)
    version = await engine.update_weights_from_distributed(
        _list_of(arguments, "names", lambda n: isinstance(n, str), "strings"),
        _list_of(arguments, "dtypes", lambda d: isinstance(d, str), "strings"),
        _list_of(arguments, "shapes", _is_shape, "lists of integers"),
        weight_version=_optional_str(arguments, "weight_version"),
        reset_prefix_cache=_bool(arguments, "reset_prefix_cache", True),
        bucket_bytes=_int(arguments, "bucket_bytes", 0) or None,
    )
    return {"success": True, "weight_version": version}


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> dict[str, Any]:
    engine = _engine(request)
    arguments = await _arguments(request)
    path = arguments.get("path", arguments.get("model_path"))  # model_path: SGLang's name
    if not isinstance(path, str) or not path:
        raise bad_request("path (a safetensors folder on the server) is required", "path")
    version = await engine.update_weights_from_disk(
        path,
        weight_version=_optional_str(arguments, "weight_version"),
        reset_prefix_cache=_bool(arguments, "reset_prefix_cache", True),
    )
    return {"success": True, "weight_version": version}


@router.post("/destroy_weight_update_group")
async def destroy_weight_update_group(request: Request) -> dict[str, bool]:
    await _engine(request).destroy_weight_update_group()
    return {"success": True}


@router.get("/weight_version")
async def weight_version(request: Request) -> dict[str, str]:
    return {"weight_version": await _engine(request).get_weight_version()}
