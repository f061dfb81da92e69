"""vLLM's native RL names beside shoal's RL routes (`shoal serve --enable-rl-endpoints`), for
what the verbs' routes of shoal/rl_verbs.py do not spell already (/sleep, /wake_up,
/is_sleeping, /pause, /resume are shoal's and vLLM's alike):

- `POST /inference/v1/generate`: token ids in and out (vLLM's `GenerateRequest`: `token_ids`,
  `sampling_params` by vLLM's names, `request_id`), each choice with shoal's `weight_versions`
  (and, with `sampling_params.return_routed_experts`, its `routed_experts`);
- `POST /abort_requests {request_ids?}`, `POST /reset_prefix_cache`, `POST /collective_rpc
  {method, args, kwargs, timeout}`, `GET /get_world_size`;
- the four-phase weight transfer TRL's async GRPO drives: `POST /init_weight_transfer_engine
  {init_info}`, `/start_weight_update {is_checkpoint_format}`, `/update_weights {update_info}`
  (any number), `/finish_weight_update`. The "nccl" backend (`init_info` with
  `master_address`, `master_port`, `rank_offset`, `world_size`) is shoal's weight-update group
  (gloo on a CPU, NCCL on a GPU): the trainer sends with `shoal.rl.WeightSender`, and each
  `/update_weights` is one `update_weights_from_distributed`. The "ipc" backend (`init_info`
  without an address): each `/update_weights` carries the tensors' handles pickled
  (`ipc_handles_pickled`: CUDA IPC, or a CPU tensor by value), read by the restricted
  unpickler of shoal/entrypoints/openai/tensor_payloads.py, and is one
  `update_weights_from_tensors`.

Shapes from vLLM's vllm/entrypoints/serve/ (GenerateRequest, GenerateResponse) and
vllm/distributed/weight_transfer/{nccl,ipc}_engine.py; the client is TRL's
trl/experimental/async_grpo/vllm_client.py.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from shoal.entrypoints.openai.errors import bad_request, engine_dead
from shoal.entrypoints.openai.native_requests import abort_all, native_requests, until_aborted
from shoal.entrypoints.openai.serving import clamp_logprob, until_disconnected
from shoal.entrypoints.openai.tensor_payloads import vllm_ipc_tensors
from shoal.frontend.output_processor import OutputKind
from shoal.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shoal.frontend.async_llm import AsyncLLM
    from shoal.outputs import CompletionOutput

logger = logging.getLogger(__name__)

router = APIRouter()


def _engine(request: Request) -> AsyncLLM:
    engine = request.app.state.shoal.engine
    if engine.errored:
        raise engine_dead()
    return engine


async def _body(request: Request) -> dict[str, Any]:
    import json

    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


# ---- token-in / token-out -----------------------------------------------------------------------


@router.post("/inference/v1/generate")
async def inference_generate(request: Request) -> Any:
    engine = _engine(request)
    body = await _body(request)
    token_ids = body.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids or not all(_is_id(t) for t in token_ids):
        raise bad_request("token_ids must be a non-empty list of token ids", "token_ids")
    if body.get("stream"):
        raise bad_request("stream is not supported on /inference/v1/generate: ask for the whole answer", "stream")
    fields = body.get("sampling_params") or {}
    if not isinstance(fields, dict):
        raise bad_request("sampling_params must be an object", "sampling_params")
    try:
        params = SamplingParams(**fields)
    except TypeError as exc:
        raise bad_request(f"bad sampling_params: {exc}", "sampling_params") from None
    request_id = str(body.get("request_id") or uuid.uuid4().hex)
    engine.input_processor.validate_prompt(token_ids)
    engine.input_processor.validate_params(params)
    return await until_disconnected(request, _generate(engine, request, request_id, token_ids, params))


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def _generate(
    engine: AsyncLLM, request: Request, request_id: str, token_ids: list[int], params: SamplingParams
) -> dict[str, Any]:
    last = None
    with native_requests(request).track(request_id) as aborted:
        engine_id = f"inference-{request_id}-{uuid.uuid4().hex[:8]}"
        outputs = engine.generate({"prompt_token_ids": token_ids}, params, engine_id, output_kind=OutputKind.CUMULATIVE)
        async for output in until_aborted(outputs, aborted):
            last = output
    completions = last.outputs if last is not None else []
    return {
        "request_id": request_id,
        "choices": [_choice(c, params, aborted.is_set()) for c in completions],
        "prompt_logprobs": None,
    }


def _choice(completion: CompletionOutput, params: SamplingParams, aborted: bool) -> dict[str, Any]:
    finish = completion.finish_reason or ("abort" if aborted else None)
    choice: dict[str, Any] = {
        "index": completion.index,
        "token_ids": list(completion.token_ids),
        "finish_reason": finish,
        "logprobs": None,
        # shoal's: which weights sampled which tokens (indices into token_ids).
        "weight_versions": [{"version": s.version, "start": s.start, "end": s.end} for s in completion.weight_versions],
    }
    if params.return_routed_experts:
        # [position][layer][k]: prompt positions, then output tokens but the last; -1 in dense layers.
        ids = completion.routed_experts
        choice["routed_experts"] = ids.tolist() if ids is not None else None
    if params.logprobs is not None and completion.logprobs:
        choice["logprobs"] = {
            "content": [_logprob(t, p, params.logprobs) for t, p in zip(completion.token_ids, completion.logprobs)]
        }
    return choice


def _logprob(token_id: int, position: dict, num_top: int) -> dict[str, Any]:
    def entry(tid: int, lp: Any) -> dict[str, Any]:
        return {"token": f"token_id:{tid}", "logprob": clamp_logprob(lp.logprob), "bytes": None}

    ranked = sorted(position.items(), key=lambda item: item[1].rank)[:num_top]
    return {**entry(token_id, position[token_id]), "top_logprobs": [entry(t, lp) for t, lp in ranked]}


# ---- control --------------------------------------------------------------------------------------


@router.post("/abort_requests")
async def abort_requests(request: Request) -> Response:
    """vLLM's: the requests named (native generate requests by their `request_id`), or every
    request in the engine."""
    engine = _engine(request)
    request_ids = (await _body(request)).get("request_ids")
    if request_ids:
        if not isinstance(request_ids, list):
            raise bad_request("request_ids must be a list of strings", "request_ids")
        native_requests(request).abort([str(r) for r in request_ids])
    else:
        await abort_all(engine)
    return Response(status_code=200)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, bool]:
    return {"success": await _engine(request).reset_prefix_cache()}


@router.post("/collective_rpc")
async def collective_rpc(request: Request) -> dict[str, Any]:
    """Call a worker method (shoal's, or a worker extension's) on every worker; the answers in
    rank order."""
    body = await _body(request)
    method = body.get("method")
    if not isinstance(method, str) or not method or method.startswith("_"):
        raise bad_request("method must name a public worker method", "method")
    args, kwargs = body.get("args") or [], body.get("kwargs") or {}
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise bad_request("args must be a list and kwargs an object")
    results = await _engine(request).collective_rpc(method, tuple(args), kwargs, body.get("timeout"))
    return {"results": results}


@router.get("/get_world_size")
async def get_world_size(request: Request) -> dict[str, int]:
    """The engine's workers (tensor × pipeline parallel), the ranks it adds to a weight-transfer
    group besides the trainer's."""
    return {"world_size": _engine(request).config.parallel_config.world_size}


# ---- the four-phase weight transfer --------------------------------------------------------------


@dataclass
class WeightTransfer:
    """The server's side of vLLM's weight-transfer lifecycle."""

    backend: str | None = None  # "nccl" (shoal's group: gloo on a CPU) or "ipc"; None: not initialized
    updating: bool = False  # between /start_weight_update and /finish_weight_update
    num_updates: int = 0  # /update_weights calls in this update


def _transfer(request: Request) -> WeightTransfer:
    state = request.app.state
    if not hasattr(state, "weight_transfer"):
        state.weight_transfer = WeightTransfer()
    return state.weight_transfer


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
    engine = _engine(request)
    init_info = (await _body(request)).get("init_info")
    if not isinstance(init_info, dict):
        raise bad_request("init_info (an object) is required", "init_info")
    transfer = _transfer(request)
    if "master_address" in init_info:
        missing = [k for k in ("master_port", "world_size") if k not in init_info]
        if missing:
            raise bad_request(f"init_info needs {missing} for the nccl backend", "init_info")
        await engine.init_weight_update_group(
            str(init_info["master_address"]),
            int(init_info["master_port"]),
            int(init_info.get("rank_offset", 1)),
            int(init_info["world_size"]),
            init_info.get("backend"),
        )
        transfer.backend = "nccl"
    else:
        transfer.backend = "ipc"
    return {"success": True, "backend": transfer.backend}


@router.post("/start_weight_update")
async def start_weight_update(request: Request) -> dict[str, Any]:
    body = await _body(request)
    transfer = _transfer(request)
    if transfer.backend is None:
        raise bad_request("no weight-transfer engine: call /init_weight_transfer_engine first")
    if body.get("is_checkpoint_format", True) is not True:
        raise bad_request(
            "shoal takes weights in checkpoint format only (Hugging Face names, whole tensors): "
            "is_checkpoint_format must be true",
            "is_checkpoint_format",
        )
    transfer.updating, transfer.num_updates = True, 0
    return {"success": True}


@router.post("/update_weights")
async def update_weights(request: Request) -> dict[str, Any]:
    engine = _engine(request)
    transfer = _transfer(request)
    if not transfer.updating:
        raise bad_request("no weight update is under way: call /start_weight_update first")
    info = (await _body(request)).get("update_info")
    if not isinstance(info, dict):
        raise bad_request("update_info (an object) is required", "update_info")
    names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
    if not isinstance(names, list) or not isinstance(dtypes, list) or not isinstance(shapes, list):
        raise bad_request("update_info needs names, dtype_names and shapes (lists)", "update_info")
    if transfer.backend == "ipc":
        try:
            tensors = vllm_ipc_tensors(info)
        except ValueError as exc:
            raise bad_request(str(exc), "update_info") from None
        version = await engine.update_weights_from_tensors(tensors, weight_version=info.get("weight_version"))
        transfer.num_updates += 1
        return {"success": True, "weight_version": version}
    version = await engine.update_weights_from_distributed(
        names,
        dtypes,
        shapes,
        weight_version=info.get("weight_version"),
        reset_prefix_cache=True,
        bucket_bytes=info.get("bucket_bytes"),
    )
    transfer.num_updates += 1
    return {"success": True, "weight_version": version}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> dict[str, Any]:
    transfer = _transfer(request)
    if not transfer.updating:
        raise bad_request("no weight update is under way: call /start_weight_update first")
    transfer.updating = False
    return {"success": True, "num_updates": transfer.num_updates}
