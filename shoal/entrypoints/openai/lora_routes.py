"""LoRA adapters over HTTP, under vLLM's names: `--lora-modules name=path ...` loaded at start,
each adapter a model of `/v1/models` (with its `parent`, the base model) that the OpenAI `model`
field chooses, and with `--enable-runtime-lora-updating` the routes `POST /v1/load_lora_adapter`
and `POST /v1/unload_lora_adapter`. A bad adapter is a 400 that says what is wrong; the engine
keeps serving."""

from __future__ import annotations

import itertools
import json
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from shoal.entrypoints.openai.openapi import error_responses
from shoal.lora.request import LoRARequest

if TYPE_CHECKING:
    from shoal.frontend.async_llm import AsyncLLM

# lora_int_id for adapters named without one (the server's own numbering, from 1).
_int_ids = itertools.count(1)


def parse_lora_module(text: str) -> LoRARequest:
    """One `--lora-modules` value: `name=path`, or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return LoRARequest(spec["name"], next(_int_ids), spec["path"], base_model_name=spec.get("base_model_name"))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"--lora-modules {text!r}: a JSON value needs 'name' and 'path' ({exc})") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path")
    return LoRARequest(name, next(_int_ids), path)


async def load_lora_modules(engine: AsyncLLM, lora_modules: tuple[LoRARequest, ...]) -> None:
    for lora_request in lora_modules:
        await engine.add_lora(lora_request)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def lora_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=error_responses(400))
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> str:
        engine: AsyncLLM = request.app.state.shoal.engine
        if body.lora_name in engine.lora_adapters.loaded:
            raise ValueError(f"The lora adapter '{body.lora_name}' has already been loaded.")
        await engine.add_lora(LoRARequest(body.lora_name, next(_int_ids), body.lora_path))
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=error_responses(400, 404))
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> str:
        engine: AsyncLLM = request.app.state.shoal.engine
        if body.lora_name not in engine.lora_adapters.loaded:
            raise ValueError(f"The lora adapter '{body.lora_name}' cannot be found.")
        await engine.remove_lora(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    return router
