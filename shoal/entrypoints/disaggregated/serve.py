"""`shoal serve --disaggregate prefill=N,decode=M`: the OpenAI server on the prefill/decode
proxy (`DisaggregatedLLM`), its engines Ray actors (docs/disaggregation.md)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from shoal.entrypoints.disaggregated.engine_pool import DisaggregationOptions
from shoal.entrypoints.disaggregated.proxy import DisaggregatedLLM

if TYPE_CHECKING:
    from shoal.config import EngineArgs
    from shoal.entrypoints.openai.api_server import ServerArgs

logger = logging.getLogger(__name__)


def disaggregation_options(spec: str, engine_args: EngineArgs, transfer_timeout_s: float) -> DisaggregationOptions:
    """The flag's counts; on GPU each engine takes a whole GPU (a fraction when it says so with
    --gpu-memory-utilization below one half: two engines then share a GPU)."""
    on_gpu = engine_args.device == "cuda" or (engine_args.device == "auto" and _has_cuda())
    shares_gpu = on_gpu and engine_args.gpu_memory_utilization <= 0.5
    return DisaggregationOptions.parse(
        spec,
        num_gpus_per_engine=(0.5 if shares_gpu else 1.0) if on_gpu else 0.0,
        num_cpus_per_engine=1.0,
        transfer_timeout_s=transfer_timeout_s,
        stall_timeout_s=3 * transfer_timeout_s,
    )


def run_disaggregated(engine_args: EngineArgs, server_args: ServerArgs, spec: str, transfer_timeout_s: float) -> None:
    from shoal.entrypoints.openai.api_server import run_server

    options = disaggregation_options(spec, engine_args, transfer_timeout_s)
    logger.info("disaggregated serving: %d prefill and %d decode engines", options.num_prefill, options.num_decode)
    run_server(engine_args, server_args, make_engine=lambda args: DisaggregatedLLM(args, options))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
