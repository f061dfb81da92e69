"""The OpenAI-compatible server: `build_app` (the FastAPI app around one `AsyncLLM`) and `serve`
(uvicorn on uvloop, as `shoal serve` runs it).

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`, `GET /health`
(503 once the engine is dead), `GET /metrics` (Prometheus), `POST /tokenize`, `POST /detokenize`,
`GET /tokenizer_info` (the tokenizer's configuration, as vLLM's), `GET /version` (with the
engine core's pid), `GET /load` (requests in flight, as vLLM's) and `POST /invocations`
(SageMaker's route, as vLLM serves it: a chat completion or a completion by the body's shape). With `enable_rl_endpoints`, the RL rollout routes of `rl_routes.py` (sleep /
wake_up, pause / resume). With an API key every route but `/health`,
`/metrics` and `/version` needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import socket
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from fastapi import APIRouter, Body, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

import shoal
from shoal import envs
from shoal.entrypoints.openai.errors import bad_request, engine_dead, install_exception_handlers
from shoal.entrypoints.openai.lora_routes import load_lora_modules, lora_router
from shoal.entrypoints.openai.metrics import ServerMetrics
from shoal.entrypoints.openai.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware
from shoal.entrypoints.openai.openapi import (
    GENERATE_ERRORS,
    READ_ERRORS,
    TOKENIZER_ERRORS,
    error_responses,
    install_openapi,
    json_or_stream,
)
from shoal.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ServerLoad,
    TokenizeRequest,
    TokenizeResponse,
)
from shoal.entrypoints.openai.serving import make_admission
from shoal.entrypoints.openai.serving_chat import ChatOptions, OpenAIServingChat
from shoal.entrypoints.openai.serving_completion import OpenAIServingCompletion
from shoal.entrypoints.openai.serving_limits import ServingLimits
from shoal.entrypoints.openai.stats_logger import StatsLogger
from shoal.errors import EngineDeadError

if TYPE_CHECKING:
    from shoal.config import EngineArgs
    from shoal.frontend.async_llm import AsyncLLM
    from shoal.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# Probes and scrapers need no API key.
OPEN_PATHS = ("/health", "/metrics", "/version")
_ENGINE_CALL_TIMEOUT_S = 10.0
RequestT = TypeVar("RequestT", bound=BaseModel)
_UNWIND_S = 0.1


@dataclass(frozen=True)
class ServerArgs:
    """The server's own settings (the engine's are `EngineArgs`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_body_bytes: int = 10 * 1024 * 1024
    stats_interval_s: float = 10.0  # 0 turns the periodic stats line off
    uvicorn_log_level: str = "info"
    access_log: bool = True
    graceful_shutdown_timeout_s: int = 5
    # The RL rollout routes (sleep, wake_up, pause, resume, ...): off unless asked for.
    enable_rl_endpoints: bool = False
    # LoRA adapters loaded at start (--lora-modules), and the load / unload routes.
    lora_modules: tuple[LoRARequest, ...] = ()
    enable_runtime_lora_updating: bool = False
    # Chat outputs: tool calls and reasoning (see serving_chat.ChatOptions).
    chat: ChatOptions = dataclasses.field(default_factory=ChatOptions)
    # Overload: waiting requests, request and stream-stall timeouts (serving_limits.py).
    limits: ServingLimits = dataclasses.field(default_factory=ServingLimits)


@dataclass
class ServerState:
    engine: AsyncLLM
    args: ServerArgs
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    metrics: ServerMetrics
    stats_logger: StatsLogger


def build_app(engine: AsyncLLM, args: ServerArgs | None = None, shutdown_engine: bool = False) -> FastAPI:
    """The app serving `engine`; with `shutdown_engine` the app's shutdown also ends the engine."""
    args = args or ServerArgs()
    tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="shoal-tokenizer")
    metrics = ServerMetrics(engine.config.model_config.served_model_name, cache_config_info(engine))
    stats_logger = StatsLogger(engine, args.stats_interval_s, metrics)
    engine.add_stats_listener(metrics.on_stats)
    engine.add_stats_listener(stats_logger.on_stats)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await load_lora_modules(engine, args.lora_modules)
        task = asyncio.create_task(stats_logger.run()) if args.stats_interval_s > 0 else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            tokenizer_thread.shutdown(wait=False)
            if shutdown_engine:
                # Requests that uvicorn cancelled when its graceful-shutdown time ran out abort
                # themselves as their cancellation unwinds: let that happen while the engine runs.
                await asyncio.sleep(_UNWIND_S)
                engine.shutdown()

    app = FastAPI(title="shoal", version=shoal.__version__, lifespan=lifespan)
    admission = make_admission(engine, args.limits)
    app.state.shoal = ServerState(
        engine=engine,
        args=args,
        completion=OpenAIServingCompletion(engine, tokenizer_thread, args.limits, admission),
        chat=OpenAIServingChat(engine, tokenizer_thread, args.chat, args.limits, admission),
        metrics=metrics,
        stats_logger=stats_logger,
    )
    install_openapi(app, engine.config.model_config)
    app.include_router(router)
    if envs.SHOAL_TORCH_PROFILER_DIR:  # as vLLM: the profiler routes exist only when asked for
        app.include_router(profiler_router)
    if args.enable_rl_endpoints:
        from shoal.entrypoints.openai import rl_routes

        app.include_router(rl_routes.rl_router())
    if args.enable_runtime_lora_updating:
        app.include_router(lora_router())
    install_exception_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=args.max_request_body_bytes)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, open_paths=OPEN_PATHS)  # outermost
    return app


def cache_config_info(engine: AsyncLLM) -> dict[str, Any]:
    """The KV cache's settings and its size in blocks (`shoal:cache_config_info`'s labels, with
    vLLM's `num_gpu_blocks` for the number of blocks on any device)."""
    info = dataclasses.asdict(engine.config.cache_config)
    info["num_gpu_blocks"] = getattr(engine.engine_core, "num_kv_blocks", None)
    return info


def _state(request: Request) -> ServerState:
    return request.app.state.shoal


def _alive_engine(request: Request) -> AsyncLLM:
    engine = _state(request).engine
    if engine.errored:
        raise engine_dead()
    return engine


router = APIRouter()


@router.get(
    "/health",
    response_class=Response,
    responses={200: {"description": "The engine is alive (an empty body)"}, **error_responses(503)},
)
async def health(request: Request) -> Response:
    engine = _state(request).engine
    try:
        if engine.errored:
            raise EngineDeadError("engine is dead")
        await asyncio.wait_for(engine.check_health(), _ENGINE_CALL_TIMEOUT_S)
    except (EngineDeadError, TimeoutError):
        return engine_dead().to_response()
    return Response(status_code=200)


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"description": "Prometheus metrics", "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}
    },
)
async def metrics(request: Request) -> Response:
    state = _state(request)
    if not state.engine.errored:
        with contextlib.suppress(EngineDeadError, TimeoutError):
            state.metrics.set_engine_stats(await asyncio.wait_for(state.engine.get_stats(), _ENGINE_CALL_TIMEOUT_S))
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version(request: Request) -> dict[str, Any]:
    return {"version": shoal.__version__, "engine_core_pid": getattr(_state(request).engine, "engine_core_pid", None)}


@router.get("/load", responses=error_responses(*READ_ERRORS))
async def load(request: Request) -> ServerLoad:
    """The requests being answered now (admitted, their responses not yet ended), as vLLM's route."""
    return ServerLoad(server_load=_state(request).completion.admission.num_requests)


@router.get("/v1/models", responses=error_responses(*READ_ERRORS))
async def list_models(request: Request) -> ModelList:
    """The served model, then each LoRA adapter (its `parent` the served model)."""
    base = _model_card(request)
    adapters = _state(request).engine.lora_adapters.loaded.values()
    cards = [ModelCard(id=a.lora_name, root=a.path, parent=base.id, max_model_len=base.max_model_len) for a in adapters]
    return ModelList(data=[base, *cards])


@router.get("/v1/models/{model:path}", responses=error_responses(*READ_ERRORS, 400, 404))
async def retrieve_model(model: Annotated[str, Path(min_length=1, max_length=1024)], request: Request) -> ModelCard:
    _state(request).completion.check_model(model)
    return next(card for card in (await list_models(request)).data if card.id == model)


def _model_card(request: Request) -> ModelCard:
    model_config = _state(request).engine.config.model_config
    return ModelCard(
        id=model_config.served_model_name, root=model_config.model, max_model_len=model_config.max_model_len
    )


@router.post(
    "/v1/completions",
    response_model=None,
    responses={**json_or_stream(CompletionResponse), **error_responses(*GENERATE_ERRORS)},
)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    _alive_engine(request)
    return await _state(request).completion.create_completion(body, request)


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={**json_or_stream(ChatCompletionResponse), **error_responses(*GENERATE_ERRORS)},
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    _alive_engine(request)
    return await _state(request).chat.create_chat_completion(body, request)


@router.post("/invocations", response_model=None, include_in_schema=False)
async def invocations(body: Annotated[dict[str, Any], Body()], request: Request) -> Response:
    """SageMaker's inference route, as vLLM serves it: a body with `messages` is a chat
    completion, one with `prompt` a completion. (Not in the OpenAPI schema: its bodies and
    answers are those of the two routes.)"""
    if "messages" in body:
        return await create_chat_completion(_parsed(ChatCompletionRequest, body), request)
    if "prompt" in body:
        return await create_completion(_parsed(CompletionRequest, body), request)
    raise bad_request("/invocations needs 'messages' (a chat completion) or 'prompt' (a completion)")


def _parsed(model: type[RequestT], body: dict[str, Any]) -> RequestT:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


@router.post("/tokenize", responses=error_responses(*TOKENIZER_ERRORS))
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state = _state(request)
    state.completion.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of 'prompt' and 'messages'")
    serving = state.completion
    _require_tokenizer(serving)
    if body.messages is not None:
        args = (body.messages, body.add_generation_prompt, body.chat_template, body.chat_template_kwargs, body.tools)
        _, token_ids = await state.chat.render(*args)
    else:
        encode = functools.partial(serving.tokenizer.encode, add_special_tokens=body.add_special_tokens)
        token_ids = list(await serving.in_tokenizer_thread(encode, body.prompt))
    token_strs = serving.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(token_ids), max_model_len=serving.max_model_len, tokens=token_ids, token_strs=token_strs
    )


@router.post("/detokenize", responses=error_responses(*TOKENIZER_ERRORS))
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    serving = _state(request).completion
    serving.check_model(body.model)
    _require_tokenizer(serving)
    vocab_size = serving.model_config.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of the vocabulary [0, {vocab_size})", "tokens")
    return DetokenizeResponse(prompt=await serving.in_tokenizer_thread(serving.tokenizer.decode, body.tokens))


@router.get("/tokenizer_info", responses=error_responses(*READ_ERRORS, 400))
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """The tokenizer's configuration (what its tokenizer_config.json holds), with its class
    and chat template, as vLLM's route answers it."""
    serving = _state(request).completion
    _require_tokenizer(serving)
    return tokenizer_config(serving.tokenizer)


def tokenizer_config(tokenizer: Any) -> dict[str, Any]:
    info: dict[str, Any] = {
        key: value for key, value in tokenizer.init_kwargs.items() if _is_json_value(value) and key != "chat_template"
    }
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            info[name] = str(value)
    info["tokenizer_class"] = type(tokenizer).__name__
    info["model_max_length"] = tokenizer.model_max_length if tokenizer.model_max_length < 2**63 else None
    info["chat_template"] = getattr(tokenizer, "chat_template", None)
    return info


def _is_json_value(value: Any) -> bool:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_value(v) for k, v in value.items())
    return False


profiler_router = APIRouter()


@profiler_router.post("/start_profile")
async def start_profile(request: Request) -> Response:
    """torch.profiler on every worker until /stop_profile; traces go to $SHOAL_TORCH_PROFILER_DIR."""
    await _alive_engine(request).start_profile()
    return Response(status_code=200)


@profiler_router.post("/stop_profile")
async def stop_profile(request: Request) -> list[dict[str, Any]]:
    """Per worker: its trace's path, the wall and device-busy seconds, the top operations."""
    return await _alive_engine(request).stop_profile()


def _require_tokenizer(serving: OpenAIServingCompletion) -> None:
    if serving.tokenizer is None:
        raise bad_request("this model has no tokenizer (a config-only folder): use token ids")


# ---- running it ----------------------------------------------------------------------------------


async def serve(
    engine_args: EngineArgs, args: ServerArgs, make_engine: Callable[[EngineArgs], AsyncLLM] | None = None
) -> None:
    """Start the engine (`make_engine`'s, else an `AsyncLLM` with its own engine-core process),
    then serve until SIGINT/SIGTERM; the engine core process ends with us."""
    from shoal.frontend.async_llm import AsyncLLM

    _check_port_free(args.host, args.port)  # fail before the model loads, not after
    engine = make_engine(engine_args) if make_engine is not None else AsyncLLM.from_engine_args(engine_args)
    try:
        # Bound after the engine core started, so that its process never holds our socket.
        sock = _bind(args.host, args.port)
        app = build_app(engine, args, shutdown_engine=True)
        config = _uvicorn_config(app, args)
        import uvicorn

        server = uvicorn.Server(config)
        ready = asyncio.create_task(_announce_when_ready(server, sock, engine))
        cut_log = CutRequestsLog(args.graceful_shutdown_timeout_s)
        uvicorn_logger = logging.getLogger("uvicorn.error")
        uvicorn_logger.addFilter(cut_log)
        try:
            await server.serve(sockets=[sock])
        finally:
            ready.cancel()
            uvicorn_logger.removeFilter(cut_log)
    finally:
        engine.shutdown()


class CutRequestsLog(logging.Filter):
    """What the log says when a shutdown's grace period ends with requests still running:
    uvicorn cancels their tasks, logs their count as an error and then a CancelledError
    traceback per request; this filter (on uvicorn's logger) replaces all of it with one line."""

    def __init__(self, grace_period_s: float) -> None:
        super().__init__()
        self.grace_period_s = grace_period_s

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Cancel %s running task"):  # uvicorn's count of the cut tasks
            num_requests = record.args[0] if isinstance(record.args, tuple) and record.args else "some"
            logger.warning(
                "Shutdown: %s request(s) still running after the %g s grace period were cut",
                num_requests,
                self.grace_period_s,
            )
            return False
        # uvicorn cancels a request's task only at shutdown, so the cancellation is that cut.
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def _uvicorn_config(app: FastAPI, args: ServerArgs) -> Any:
    import uvicorn

    return uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=args.graceful_shutdown_timeout_s,
        timeout_keep_alive=10,
    )


async def _announce_when_ready(server: Any, sock: socket.socket, engine: AsyncLLM) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    logger.info(
        "shoal is serving %s at http://%s:%d/v1 (engine core pid %s)",
        engine.config.model_config.served_model_name,
        host,
        port,
        getattr(engine, "engine_core_pid", None),
    )


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    return sock


def _check_port_free(host: str, port: int) -> None:
    if port != 0:
        _bind(host, port).close()


def run_server(
    engine_args: EngineArgs, args: ServerArgs, make_engine: Callable[[EngineArgs], AsyncLLM] | None = None
) -> None:
    """Run `serve` on uvloop (where installed)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(engine_args, args, make_engine))
        return
    uvloop.run(serve(engine_args, args, make_engine))
