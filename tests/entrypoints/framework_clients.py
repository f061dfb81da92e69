"""Faithful ports of the RL frameworks' calls on an SGLang server, for the frameworks that cannot
be installed beside shoal (tests/entrypoints/test_rl_native_apis.py):

- AReaL 1.0.4 (PyPI `areal`, which pins torch<2.11 and transformers<=5.3.0): the request
  builders and the response parser of `SGLangBackend` in areal/engine/sglang_remote.py (the
  non-LoRA, PP=1 paths, with the defaults of `GenerationHyperparameters` in
  areal/api/cli_args.py), and `init_custom_process_group` of areal/engine/core/distributed.py,
  the process group its trainers broadcast new weights over;
- slime (not on PyPI), THUDM/slime: external engines' discovery in
  slime/backends/sglang_utils/external.py@130027af, the abort-until-idle loop and
  `num_requests_from_load` in slime/backends/sglang_utils/server_control.py@15b8e507, the
  /generate payload and the reading of its answer in slime/rollout/sglang_rollout.py@3c9aa092
  (with `Sample.update_from_meta_info` of slime/utils/types.py), and the engine calls of
  slime/backends/sglang_utils/http_server_engine.py@a18dc5dc;
- SGLang's trainer-side tensor payloads (what slime's update_weight_from_tensor.py and veRL's
  SGLang adapter send to /update_weights_from_tensor): `MultiprocessingSerializer.serialize(obj,
  output_str=True)` of python/sglang/srt/utils/common.py (ForkingPickler, then base64) and the
  multi-dtype `FlattenedTensorBucket` of python/sglang/srt/weight_sync/tensor_bucket.py (each
  tensor's bytes back to back in one uint8 tensor, byte offsets in its metadata).

The payloads, endpoints and the fields read from the answers are theirs; only the transport
(httpx instead of aiohttp or requests) differs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# ---- AReaL ----------------------------------------------------------------------------------------


@dataclass
class HttpRequest:
    endpoint: str
    payload: dict[str, Any]
    method: str = "POST"


@dataclass
class HttpGenerationResult:
    output_tokens: list[int]
    output_logprobs: list[float]
    stop_reason: str


class ArealSGLangBackend:
    """areal/engine/sglang_remote.py `SGLangBackend` (AReaL 1.0.4)."""

    def build_generation_request(self, input_ids: list[int], max_new_tokens: int, greedy: bool) -> HttpRequest:
        sample_params = {
            "top_p": 1.0,
            "top_k": int(1e8),
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0 if greedy else 1.0,
            "stop_token_ids": [],
            "ignore_eos": False,
            "skip_special_tokens": True,
            "frequency_penalty": 0.0,
        }
        payload = {
            "input_ids": list(input_ids),
            "image_data": None,
            "sampling_params": sample_params,
            "return_logprob": True,
            "stream": False,
        }
        return HttpRequest(endpoint="/generate", payload=payload)

    def parse_generation_response(self, response: dict[str, Any]) -> HttpGenerationResult:
        meta_info = response["meta_info"]
        finish_reason = meta_info["finish_reason"]
        stop_reason = finish_reason["type"]
        stop_message = finish_reason.get("message", "")
        if stop_reason == "abort" and stop_message.startswith("Abort before prefill"):
            return HttpGenerationResult([], [], stop_reason)
        output_tokens = [x[1] for x in meta_info["output_token_logprobs"]]
        output_logprobs = [x[0] for x in meta_info["output_token_logprobs"]]
        return HttpGenerationResult(output_tokens, output_logprobs, stop_reason)

    def build_disk_weight_update_requests(self, path: str) -> list[HttpRequest]:
        payload = {"model_path": str(path), "abort_all_requests": True}
        return [HttpRequest(endpoint="/update_weights_from_disk", payload=payload)]

    def build_distributed_weight_update_requests(
        self, param_specs: list[tuple[str, str, list[int]]]
    ) -> list[HttpRequest]:
        payload = {
            "names": [name for name, _, _ in param_specs],
            "dtypes": [dtype for _, dtype, _ in param_specs],
            "shapes": [shape for _, _, shape in param_specs],
            "group_name": "update_weight_group",
            "abort_all_requests": True,
        }
        return [HttpRequest(endpoint="/update_weights_from_distributed", payload=payload)]

    def build_init_weights_group_request(
        self, master_address: str, master_port: int, server_idx: int, gen_world_size: int, instance_size: int = 1
    ) -> HttpRequest:
        payload = {
            "master_address": master_address,
            "master_port": str(master_port),
            "rank_offset": 1 + server_idx * instance_size,
            "world_size": gen_world_size + 1,
            "backend": "gloo",  # current_platform.communication_backend on a CPU
            "group_name": "update_weight_group",
        }
        return HttpRequest(endpoint="/init_weights_update_group", payload=payload)

    def get_pause_request(self) -> HttpRequest:
        return HttpRequest(endpoint="/pause_generation", payload={})

    def get_resume_request(self) -> HttpRequest:
        return HttpRequest(endpoint="/continue_generation", payload={})

    def get_offload_request(self) -> HttpRequest:
        return HttpRequest(endpoint="/release_memory_occupation", payload={})

    def get_onload_request(self, tags: list[str] | None = None) -> HttpRequest:
        payload = {"tags": tags} if tags is not None else {}
        return HttpRequest(endpoint="/resume_memory_occupation", payload=payload)


def send(http: httpx.Client, request: HttpRequest) -> Any:
    """AReaL's `arequest_with_retry`, once: raise for the status, answer the JSON."""
    response = http.request(request.method, request.endpoint, json=request.payload)
    response.raise_for_status()
    return response.json()


def areal_init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str) -> Any:
    """areal/engine/core/distributed.py `init_custom_process_group` (the path with an
    init_method and no store)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    timeout = default_pg_timeout
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
        group_desc=group_name,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


# ---- slime --------------------------------------------------------------------------------------


def slime_discover_external_engines(http: httpx.Client) -> list[dict[str, Any]]:
    """external.py `get_server_info` (/server_info, else /get_server_info) and
    `discover_external_engines`."""
    server_info = None
    for endpoint in ("/server_info", "/get_server_info"):
        response = http.get(endpoint)
        if response.status_code == 200:
            server_info = response.json()
            break
    assert server_info is not None
    pp_size = int(server_info.get("pp_size") or server_info.get("pipeline_parallel_size") or 1)
    tp_size = int(server_info.get("tp_size") or server_info.get("tensor_parallel_size") or 1)
    num_gpus = int(server_info.get("num_gpus") or server_info.get("num_gpus_per_engine") or tp_size * pp_size)
    mode = server_info.get("disaggregation_mode")
    worker_type = "encoder" if server_info.get("encoder_only") else mode if mode in ("prefill", "decode") else "regular"
    return [{"worker_type": worker_type, "num_gpus": num_gpus, "tp_size": tp_size, "pp_size": pp_size}]


def slime_wait_until_launched(http: httpx.Client, timeout_s: float = 30.0) -> bool:
    """http_server_engine.py `launch_server_process`: /health_generate, then /flush_cache,
    each until 200."""
    deadline = time.monotonic() + timeout_s
    for endpoint in ("/health_generate", "/flush_cache"):
        while http.get(endpoint).status_code != 200:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
    return True


@dataclass
class _Args:
    rollout_temperature: float = 0.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    rollout_stop: list[str] | None = None
    rollout_stop_token_ids: list[int] | None = None
    rollout_skip_special_tokens: bool = False
    weight_versions: list[str] = field(default_factory=list)


def slime_generate(http: httpx.Client, prompt_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """sglang_rollout.py `generate` for a first turn: its payload, and how it reads the answer."""
    args = _Args()
    sampling_params = {
        "temperature": args.rollout_temperature,
        "top_p": args.rollout_top_p,
        "top_k": args.rollout_top_k,
        "max_new_tokens": max_new_tokens,
        "stop": args.rollout_stop,
        "stop_token_ids": args.rollout_stop_token_ids,
        "skip_special_tokens": args.rollout_skip_special_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    payload = {"sampling_params": sampling_params, "return_logprob": True, "input_ids": prompt_ids}
    response = http.post("/generate", json=payload)
    response.raise_for_status()
    output = response.json()
    meta_info = output["meta_info"]
    if "output_token_logprobs" in meta_info:
        tokens = [item[1] for item in meta_info["output_token_logprobs"]]
        log_probs = [item[0] for item in meta_info["output_token_logprobs"]]
    else:
        tokens, log_probs = [], []
    sample: dict[str, Any] = {"tokens": tokens, "log_probs": log_probs, "response": output["text"]}
    # types.py `Sample.update_from_meta_info`
    sample["weight_versions"] = [meta_info["weight_version"]] if "weight_version" in meta_info else []
    sample["status"] = {"length": "truncated", "abort": "aborted", "stop": "completed"}[
        meta_info["finish_reason"]["type"]
    ]
    return sample


def slime_num_requests_from_load(load: Any) -> int:
    """server_control.py `num_requests_from_load` (the counts it reads)."""
    if isinstance(load, list):
        return sum(slime_num_requests_from_load(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return slime_num_requests_from_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        if isinstance(load.get(key), int):
            return load[key]
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + (waiting if isinstance(waiting, int) else 0)


def slime_abort_until_idle(http: httpx.Client, timeout_s: float = 30.0) -> None:
    """server_control.py `abort_server_until_idle`: /abort_request {abort_all}, then
    /v1/loads?include=core,disagg,queues, until no request is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        http.post("/abort_request", json={"abort_all": True}).raise_for_status()
        load = http.get("/v1/loads?include=core,disagg,queues")
        load.raise_for_status()
        if slime_num_requests_from_load(load.json()) <= 0:
            return
        assert time.monotonic() < deadline, "the engine did not become idle"
        time.sleep(0.2)


def slime_engine_call(http: httpx.Client, endpoint: str, payload: dict[str, Any] | None = None) -> httpx.Response:
    """http_server_engine.py `HttpServerEngineAdapter._make_request` (and its pause and
    continue, which post `{}` too)."""
    response = http.post(f"/{endpoint}", json=payload or {})
    response.raise_for_status()
    return response


# ---- SGLang's tensor payloads -------------------------------------------------------------------


def sglang_serialize(obj: Any) -> str:
    """MultiprocessingSerializer.serialize(obj, output_str=True)."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions, as SGLang's import of torch does)

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("utf-8")


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


def sglang_flattened_bucket(named_tensors: list[tuple[str, Any]]) -> dict[str, Any]:
    """FlattenedTensorBucket(named_tensors) as {"flattened_tensor", "metadata"}, what slime
    serializes for load_format="flattened_bucket"."""
    import torch

    parts, metadata, offset = [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.flatten().view(torch.uint8)
        metadata.append(
            FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, offset + flat.numel(), flat.numel())
        )
        parts.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}
