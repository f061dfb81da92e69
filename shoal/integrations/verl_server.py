"""The rollout server of shoal's veRL integration (shoal/integrations/verl.py), with nothing of
veRL in it: one `AsyncLLM` built from veRL's rollout and model configs, the calls veRL's agent
loop and trainer make of a server (token-in/token-out `generate`, abort and resume, sleep and
wake-up per rollout mode, KV-cache reset, weight updates), and optionally shoal's OpenAI server
on the same engine (`server_address`, for chat-completion agents).

The calls follow veRL 0.9.1's servers (verl/workers/rollout/vllm_rollout/vllm_async_server.py,
trtllm_rollout/trtllm_async_server.py): `generate(prompt_ids, sampling_params, request_id)` with
veRL's sampling dict (vLLM's names; `logprobs` a bool; `max_tokens` or SGLang's
`max_new_tokens`, else what `prompt_length` + `response_length` leave) answers a `TokenOutput`'s
fields: `token_ids`, `log_probs` (of the sampled tokens, in the engine's `logprobs_mode`),
`routed_experts` (with `enable_rollout_routing_replay`, [positions, layers, top_k]),
`stop_reason` ("completed" or "aborted"), `num_preempted`, `extra_fields` (`global_steps`,
`num_cached_tokens`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

from shoal.config import EngineArgs
from shoal.frontend.async_llm import AsyncLLM
from shoal.frontend.output_processor import OutputKind
from shoal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

HYBRID, COLOCATED, STANDALONE = "hybrid", "colocated", "standalone"
# veRL's sampling keys shoal's SamplingParams does not have, and what they become.
_RENAMED = {"max_new_tokens": "max_tokens"}


def _get(config: Any, name: str, default: Any = None) -> Any:
    """A field of a veRL config (a dataclass, an OmegaConf node or a dict)."""
    if isinstance(config, dict):
        return config.get(name, default)
    value = getattr(config, name, default)
    return default if value is None else value


def engine_args(config: Any, model_path: str, **placement: Any) -> EngineArgs:
    """shoal's engine arguments from veRL's `RolloutConfig` (`engine_kwargs.shoal` last)."""
    max_model_len = _get(config, "max_model_len") or _get(config, "prompt_length", 512) + _get(
        config, "response_length", 512
    )
    args: dict[str, Any] = {
        "model": model_path,
        "dtype": _get(config, "dtype", "auto"),
        "max_model_len": max_model_len,
        "max_num_seqs": _get(config, "max_num_seqs", 256),
        "max_num_batched_tokens": _get(config, "max_num_batched_tokens"),
        "enable_prefix_caching": _get(config, "enable_prefix_caching", True),
        "gpu_memory_utilization": _get(config, "gpu_memory_utilization", 0.5),
        "enforce_eager": _get(config, "enforce_eager", False),
        "seed": _get(config, "seed", 0),
        "logprobs_mode": _get(config, "logprobs_mode", "raw_logprobs"),
        "load_format": "dummy" if _get(config, "load_format") == "dummy" else "auto",
        "tensor_parallel_size": _get(config, "tensor_model_parallel_size", 1),
        "pipeline_parallel_size": _get(config, "pipeline_model_parallel_size", 1),
        **{k: v for k, v in placement.items() if v is not None},
    }
    engine_kwargs = _get(config, "engine_kwargs", {}) or {}
    args.update(dict(_get(engine_kwargs, "shoal", {}) or {}))
    return EngineArgs(**args)


class ShoalRolloutServer:
    """One engine serving one veRL rollout replica."""

    def __init__(
        self,
        config: Any,
        model_path: str,
        rollout_mode: str = STANDALONE,
        replica_rank: int = 0,
        token_output: Callable[..., Any] = dict,
        **placement: Any,
    ) -> None:
        self.config = config
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        self.token_output = token_output
        self.args = engine_args(config, model_path, **placement)
        self.engine: AsyncLLM | None = None
        self.global_steps: int | None = None
        self._host = "127.0.0.1"
        self._port: int | None = None
        self._http: asyncio.Task | None = None

    # ---- start -------------------------------------------------------------------------------

    async def launch_server(self, serve_http: bool = True, host: str = "127.0.0.1") -> None:
        """Build the engine (its own process, its Ray workers in the given placement), and with
        `serve_http` shoal's OpenAI server on it (RL routes on) on a free port of `host`."""
        self.engine = AsyncLLM(self.args)
        if serve_http:
            await self._serve_http(host)

    async def _serve_http(self, host: str) -> None:
        import uvicorn

        from shoal.entrypoints.openai.api_server import ServerArgs, build_app

        assert self.engine is not None
        self._host, self._port = host, _free_port(host)
        app = build_app(self.engine, ServerArgs(host=host, port=self._port, enable_rl_endpoints=True))
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=self._port, log_level="warning"))
        self._http = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)

    def get_server_address(self) -> tuple[str, int | None]:
        return self._host, self._port

    @property
    def _engine(self) -> AsyncLLM:
        if self.engine is None:
            raise RuntimeError("launch_server() first")
        return self.engine

    # ---- token in, token out -----------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        **_: Any,
    ) -> Any:
        if image_data is not None or video_data is not None:
            raise ValueError("shoal takes text models only: image_data and video_data must be None")
        params = self._sampling_params(prompt_ids, dict(sampling_params))
        last = None
        async for output in self._engine.generate(
            {"prompt_token_ids": list(prompt_ids)}, params, request_id, output_kind=OutputKind.FINAL_ONLY
        ):
            last = output
        extra = {"global_steps": self.global_steps}
        if last is None or not last.outputs:
            return self.token_output(token_ids=[], log_probs=None, stop_reason="aborted", extra_fields=extra)
        completion = last.outputs[0]
        extra["num_cached_tokens"] = last.num_cached_tokens
        log_probs = None
        if completion.logprobs is not None:
            log_probs = [p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs)]
        return self.token_output(
            token_ids=list(completion.token_ids),
            log_probs=log_probs,
            routed_experts=completion.routed_experts,
            stop_reason="aborted" if completion.finish_reason == "abort" else "completed",
            num_preempted=0,
            extra_fields=extra,
        )

    def _sampling_params(self, prompt_ids: list[int], fields: dict[str, Any]) -> SamplingParams:
        """veRL's sampling dict as shoal's, max_tokens as veRL's servers bound it."""
        for old, new in _RENAMED.items():
            if old in fields:
                fields[new] = fields.pop(old)
        prompt_length, response_length = (
            _get(self.config, "prompt_length", 512),
            _get(self.config, "response_length", 512),
        )
        room = self.args.max_model_len - len(prompt_ids) if self.args.max_model_len else response_length
        default = min(response_length, prompt_length + response_length - len(prompt_ids))
        fields["max_tokens"] = max(1, min(fields.get("max_tokens") or default, room))
        fields["logprobs"] = 0 if fields.pop("logprobs", False) else None
        fields.setdefault("repetition_penalty", _get(self.config, "repetition_penalty", 1.0))
        fields.setdefault("ignore_eos", _get(self.config, "ignore_eos", False))
        if _get(self.config, "enable_rollout_routing_replay", False):
            fields["return_routed_experts"] = True
        return SamplingParams(**fields)

    # ---- control -----------------------------------------------------------------------------

    def set_global_steps(self, global_steps: int) -> None:
        """The trainer's step whose weights serve now (in every TokenOutput's extra_fields)."""
        self.global_steps = global_steps

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Every request ends now with its tokens ("aborted"); generation holds new ones until
        `resume_generation`."""
        await self._engine.pause_generation(
            mode="abort", clear_cache=bool(_get(self.config, "enable_prefix_caching", True))
        )

    async def resume_generation(self) -> None:
        await self._engine.resume_generation()

    async def clear_kv_cache(self) -> None:
        await self._engine.reset_prefix_cache()

    async def release_kv_cache(self) -> None:
        if _get(self.config, "free_cache_engine", True):
            await self._engine.sleep(level=1)  # the KV cache; on a GPU the weights go to host memory

    async def resume_kv_cache(self) -> None:
        await self._engine.wake_up(tags=["kv_cache"])

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """COLOCATED: everything back (and the prefix cache reset); HYBRID: the tags the
        server adapter asks for (weights first, then the KV cache); STANDALONE: nothing."""
        if self.rollout_mode == STANDALONE:
            return
        await self._engine.wake_up(tags=tags)
        if self.rollout_mode == COLOCATED:
            await self._engine.reset_prefix_cache()

    async def sleep(self) -> None:
        """HYBRID: weights and KV cache freed, no copy (the trainer sends new weights before the
        next rollout); COLOCATED: level 1 (weights to host memory); STANDALONE: nothing."""
        if self.rollout_mode == STANDALONE or not _get(self.config, "free_cache_engine", True):
            return
        await self._engine.sleep(level=2 if self.rollout_mode == HYBRID else 1)

    async def is_sleeping(self) -> bool:
        return await self._engine.is_sleeping()

    async def update_weights(self, named_tensors: list[tuple[str, Any]], weight_version: str | None = None) -> str:
        """Whole Hugging Face tensors of one bucket (the server adapter sends them in turn)."""
        return await self._engine.update_weights_from_tensors(named_tensors, weight_version=weight_version)

    async def report_device_ids(self) -> list[str]:
        return await self._engine.collective_rpc("report_device")

    async def shutdown(self) -> None:
        if self._http is not None:
            self._http.cancel()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
