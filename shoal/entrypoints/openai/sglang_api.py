"""SGLang's native API beside shoal's RL routes (`shoal serve --enable-rl-endpoints`): what an
RL framework that drives SGLang servers (slime, AReaL's SGLang backend) calls besides the
verbs' routes of shoal/rl_verbs.py.

- `POST /generate`: text or token ids in, SGLang's answer out (shoal/entrypoints/openai/
  sglang_generate.py), streamed as SGLang streams it (every event the whole output so far,
  then `data: [DONE]`); a batch answers a list, a streamed batch tags events with `index`.
- `POST /abort_request {rid | abort_all}`: the request ends with what it has (finish_reason
  "abort"); `abort_all` ends every request in the engine.
- `GET|POST /flush_cache`: the prefix cache reset (400 while requests run, as SGLang's).
- `GET /server_info` (and `/get_server_info`), `GET /get_model_info`, `GET /v1/loads`,
  `GET /health_generate`.
- `POST /update_weights_from_tensor`: the trainer's tensors, shared by CUDA IPC or (CPU) shared
  memory, as SGLang's serializer writes them (direct pairs or a flattened bucket).

The shapes follow SGLang's python/sglang/srt/entrypoints/http_server.py, managers/io_struct.py
and entrypoints/v1_loads.py; errors are 400s with an OpenAI error body, as everywhere in shoal.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

import shoal
from shoal.entrypoints.openai.errors import bad_request, engine_dead, to_api_error
from shoal.entrypoints.openai.native_requests import abort_all, native_requests, until_aborted
from shoal.entrypoints.openai.serving import merge_streams, sse_event, until_disconnected
from shoal.entrypoints.openai.sglang_generate import GenerateCall, SampleRequest, answer, parse_generate
from shoal.entrypoints.openai.tensor_payloads import check_load_format, load_payload, named_tensors
from shoal.frontend.output_processor import OutputKind

if TYPE_CHECKING:
    from shoal.frontend.async_llm import AsyncLLM
    from shoal.outputs import RequestOutput

logger = logging.getLogger(__name__)

router = APIRouter()
_HEALTH_TIMEOUT_S = 20.0  # SGLang's default


def _engine(request: Request) -> AsyncLLM:
    engine = request.app.state.shoal.engine
    if engine.errored:
        raise engine_dead()
    return engine


async def _json_body(request: Request) -> Any:
    body = await request.body()
    if not body.strip():
        return {}
    try:
        return json.loads(body)
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None


# ---- /generate ----------------------------------------------------------------------------------


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Any:
    engine = _engine(request)
    try:
        call = parse_generate(await _json_body(request))
        for sample in call.samples:  # every prompt checked before anything runs
            _, token_ids = engine.input_processor.tokenize(sample.prompt)
            engine.input_processor.validate_prompt(token_ids)
            engine.input_processor.validate_params(sample.params)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    if call.stream:
        return StreamingResponse(_stream(engine, request, call), media_type="text/event-stream")
    return await until_disconnected(request, _answers(engine, request, call))


async def _answers(engine: AsyncLLM, request: Request, call: GenerateCall) -> Any:
    answers = await asyncio.gather(*(_final(engine, request, sample) for sample in call.samples))
    return answers[0] if call.is_single else list(answers)


async def _final(engine: AsyncLLM, request: Request, sample: SampleRequest) -> dict[str, Any]:
    last = None
    async for output in _outputs(engine, request, sample):
        last = output
    return await _answer(engine, sample, last)


async def _stream(engine: AsyncLLM, request: Request, call: GenerateCall) -> AsyncIterator[str]:
    streams = [_events(engine, request, sample) for sample in call.samples]
    try:
        async for i, event in merge_streams(streams):
            if not call.is_single:
                event["index"] = call.samples[i].index
            yield sse_event(event)
    except Exception as exc:  # the status line is sent: an error event, as SGLang's
        yield sse_event({"error": {"message": to_api_error(exc).info.message}})
    yield "data: [DONE]\n\n"


async def _events(engine: AsyncLLM, request: Request, sample: SampleRequest) -> AsyncIterator[dict[str, Any]]:
    """The sample's answers so far, each built as its output arrives (the merge may hold it a while)."""
    async for output in _outputs(engine, request, sample):
        yield await _answer(engine, sample, output)


async def _outputs(engine: AsyncLLM, request: Request, sample: SampleRequest) -> AsyncIterator[RequestOutput]:
    """The sample's outputs, each with everything so far, until it finishes or is aborted (by
    /abort_request: the last one then says "abort")."""
    with native_requests(request).track(sample.rid) as aborted:
        request_id = f"generate-{sample.rid}-{id(sample)}"
        outputs = engine.generate(sample.prompt, sample.params, request_id, output_kind=OutputKind.CUMULATIVE)
        last = None
        async for last in until_aborted(outputs, aborted):
            yield last
        if aborted.is_set() and (last is None or not last.finished):
            yield _aborted(sample, last)


def _aborted(sample: SampleRequest, last: RequestOutput | None) -> RequestOutput:
    """The output of a sample aborted by /abort_request: what it had, finished as aborted."""
    from shoal.outputs import CompletionOutput, RequestOutput

    if last is None:
        return RequestOutput(sample.rid, None, [], [CompletionOutput(0, "", [], finish_reason="abort")], True)
    completion = last.outputs[0]
    completion.finish_reason = "abort"
    last.finished = True
    return last


async def _answer(engine: AsyncLLM, sample: SampleRequest, output: RequestOutput | None) -> dict[str, Any]:
    if output is None:
        raise RuntimeError("the engine gave no output")
    # Built before awaiting anything: the output's completion is updated in place as tokens come.
    result = answer(sample, output, "")
    if not result["meta_info"]["weight_version"]:
        result["meta_info"]["weight_version"] = await engine.get_weight_version()
    return result


# ---- abort and cache ----------------------------------------------------------------------------


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """SGLang's `AbortReq`: `rid` (one request, or a prefix of a batch's `{rid}_{i}`), or
    `abort_all: true`."""
    engine = _engine(request)
    body = await _json_body(request)
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    if body.get("abort_all"):
        await abort_all(engine)
        native_requests(request).abort_everything()
    elif body.get("rid"):
        native_requests(request).abort([str(body["rid"])])
    else:
        raise bad_request("give rid or abort_all: true")
    return Response(status_code=200)


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    """Reset the prefix cache; as SGLang's, a 400 while requests run (try again later)."""
    if await _engine(request).reset_prefix_cache():
        return PlainTextResponse("Cache flushed.\n")
    return PlainTextResponse("Cache not flushed: requests are running.\n", status_code=400)


# ---- information ----------------------------------------------------------------------------------


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict[str, Any]:
    """SGLang's server arguments that RL frameworks read (the engine's size: slime's external
    engines), with vLLM's `vllm_config` for the same route of vLLM (TRL reads its dtype)."""
    engine = _engine(request)
    config = engine.config
    parallel = config.parallel_config
    model = config.model_config
    stats = await engine.get_stats()
    return {
        "model_path": model.model,
        "tokenizer_path": model.model,
        "served_model_name": model.served_model_name,
        "dtype": model.dtype,
        "context_length": model.max_model_len,
        "tp_size": parallel.tensor_parallel_size,
        "pp_size": parallel.pipeline_parallel_size,
        "dp_size": 1,
        "num_gpus": parallel.world_size,
        "disaggregation_mode": "null",
        "weight_version": await engine.get_weight_version(),
        "internal_states": [{"num_running_reqs": stats["num_running_reqs"]}],
        "version": shoal.__version__,
        "engine": "shoal",
        "vllm_config": {
            "model_config": {
                "model": model.model,
                "dtype": f"torch.{model.dtype}",
                "max_model_len": model.max_model_len,
            },
            "parallel_config": {
                "tensor_parallel_size": parallel.tensor_parallel_size,
                "pipeline_parallel_size": parallel.pipeline_parallel_size,
                "world_size": parallel.world_size,
            },
        },
    }


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request) -> dict[str, Any]:
    engine = _engine(request)
    model = engine.config.model_config
    return {
        "model_path": model.model,
        "tokenizer_path": model.model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": await engine.get_weight_version(),
    }


@router.get("/v1/loads")
async def loads(request: Request) -> dict[str, Any]:
    """SGLang's load report (one data-parallel rank); `include` and `format` are accepted, the
    answer is always the JSON of the core counts."""
    stats = await _engine(request).get_stats()
    running, waiting = stats["num_running_reqs"], stats["num_waiting_reqs"]
    load = {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": stats["num_used_blocks"],
        "token_usage": stats["kv_cache_usage"],
    }
    return {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
        "version": shoal.__version__,
        "dp_rank_count": 1,
        "loads": [load],
        "aggregate": {
            "total_running_reqs": running,
            "total_waiting_reqs": waiting,
            "total_reqs": running + waiting,
            "avg_token_usage": stats["kv_cache_usage"],
        },
    }


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once the engine answers and, unless generation is held (paused or asleep), has
    generated a token; 503 otherwise."""
    engine = request.app.state.shoal.engine
    try:
        if engine.errored:
            raise RuntimeError("dead")
        await asyncio.wait_for(engine.check_health(), _HEALTH_TIMEOUT_S)
        if not (await engine.is_paused() or await engine.is_sleeping()):
            await asyncio.wait_for(_one_token(engine), _HEALTH_TIMEOUT_S)
    except Exception:  # a dead, stuck or failing engine alike
        logger.warning("health_generate failed", exc_info=True)
        return Response(status_code=503)
    return Response(status_code=200)


async def _one_token(engine: AsyncLLM) -> None:
    from shoal.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    request_id = f"health-generate-{id(params)}"
    async for _ in engine.generate({"prompt_token_ids": [0]}, params, request_id, output_kind=OutputKind.FINAL_ONLY):
        pass


# ---- weights in the request ---------------------------------------------------------------------


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> dict[str, Any]:
    """SGLang's `UpdateWeightsFromTensorReqInput`: `serialized_named_tensors` (one payload per
    tensor-parallel rank, each the whole tensors: shoal's workers cut their own shards, so the
    first is read), `load_format`, `flush_cache`, `abort_all_requests`, `weight_version`. The
    payloads are read by shoal/entrypoints/openai/tensor_payloads.py's restricted unpickler."""
    engine = _engine(request)
    body = await _json_body(request)
    payloads = body.get("serialized_named_tensors") if isinstance(body, dict) else None
    if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
        raise bad_request(
            "serialized_named_tensors (a list of base64 strings, one per tensor-parallel rank) is required"
        )
    try:
        check_load_format(body.get("load_format"))
        tensors = named_tensors(load_payload(payloads[0]), body.get("load_format"))
    except ValueError as exc:
        raise bad_request(str(exc), "serialized_named_tensors") from None
    if body.get("abort_all_requests"):
        await abort_all(engine)
    version = await engine.update_weights_from_tensors(
        tensors, weight_version=body.get("weight_version"), reset_prefix_cache=bool(body.get("flush_cache", True))
    )
    return {"success": True, "message": "Succeeded to update parameter online.", "weight_version": version}
