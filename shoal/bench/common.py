"""What the offline benchmarks (`throughput`, `latency`) share: their flags, the engine and
transformers backends, and the hardware bound of a workload on this device."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from shoal.bench import hardware
from shoal.bench.report import format_rate
from shoal.bench.workloads import BenchRequest
from shoal.config import EngineArgs, EngineConfig

logger = logging.getLogger(__name__)

BACKENDS = ("shoal", "hf", "both")


def add_offline_args(parser: Any) -> None:
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="shoal",
        help="shoal; hf: transformers generate in this process; both: shoal then hf, and their ratio",
    )
    parser.add_argument("--hf-batch-size", type=int, default=64, help="requests per transformers generate call")
    parser.add_argument(
        "--in-process", action="store_true", help="run the engine core in this process (LLM(multiprocess=False))"
    )
    parser.add_argument(
        "--hardware-bound",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the device's copy bandwidth and GEMM rate and report the workload's bound",
    )
    parser.add_argument("--output-json", default=None, help="write the report here (default: printed only)")


@dataclass
class OfflineSetup:
    """The validated engine config, the model's shape, and the device's ceilings (if measured)."""

    engine_args: EngineArgs
    config: EngineConfig
    shape: hardware.ModelShape
    ceilings: hardware.DeviceCeilings | None
    in_process: bool

    @property
    def device(self) -> str:
        return self.config.device_config.device

    def backends(self, choice: str) -> list[str]:
        return ["shoal", "hf"] if choice == "both" else [choice]

    def tokenizer(self) -> Any:
        from shoal.frontend.tokenizer import get_tokenizer

        return get_tokenizer(self.config.model_config.tokenizer)

    def create_llm(self) -> Any:
        from shoal.frontend.llm import LLM

        return LLM(multiprocess=not self.in_process, **dataclasses.asdict(self.engine_args))

    def check_fits(self, requests: list[BenchRequest]) -> None:
        """Every request must fit whole, or the engine would cut its output short."""
        max_model_len = self.config.model_config.max_model_len
        longest = max(r.prompt_len + r.output_len for r in requests)
        if longest > max_model_len:
            raise ValueError(f"a request needs {longest} tokens but max_model_len is {max_model_len}")

    def bound(self, prompt_lens: list[int], output_lens: list[int]) -> hardware.WorkloadBound | None:
        if self.ceilings is None:
            return None
        scheduler = self.config.scheduler_config
        steps = hardware.simulate_steps(
            prompt_lens, output_lens, scheduler.max_num_seqs, scheduler.max_num_batched_tokens
        )
        return hardware.workload_bound(
            self.shape, self.ceilings, steps, self.config.parallel_config.tensor_parallel_size
        )


def prepare_offline(engine_args: EngineArgs, measure_bound: bool, in_process: bool) -> OfflineSetup:
    """Validate the engine arguments (raises ValueError) and, before any engine starts, measure
    the device's ceilings."""
    config = engine_args.create_engine_config()
    model_config = config.model_config
    shape = hardware.ModelShape.from_hf_config(
        model_config.hf_config, model_config.dtype, config.cache_config.kv_cache_dtype, model_config.quantization
    )
    ceilings = None
    if measure_bound:
        ceilings = hardware.measure_ceilings(config.device_config.device, model_config.dtype)
        logger.info(
            "%s (%s): read %s, copy %s, %s GEMM %s",
            ceilings.device,
            ceilings.device_name,
            format_rate(ceilings.read_bytes_per_s, "B/s"),
            format_rate(ceilings.copy_bytes_per_s, "B/s"),
            ceilings.gemm_dtype,
            format_rate(ceilings.gemm_flops_per_s, "FLOP/s"),
        )
    return OfflineSetup(engine_args, config, shape, ceilings, in_process)


def hardware_report(setup: OfflineSetup) -> dict[str, Any]:
    return {
        "ceilings": setup.ceilings.as_dict() if setup.ceilings is not None else None,
        "model": setup.shape.as_dict(),
    }


def describe_bound(setup: OfflineSetup, bound: hardware.WorkloadBound | None) -> str:
    if bound is None or setup.ceilings is None:
        return "hardware bound: not measured (--no-hardware-bound)"
    c = setup.ceilings
    return (
        f"hardware bound on {c.device} ({c.device_name}: read {format_rate(c.read_bytes_per_s, 'B/s')}, "
        f"{c.gemm_dtype} GEMM {format_rate(c.gemm_flops_per_s, 'FLOP/s')}"
        + (f", fp8 GEMM {format_rate(c.fp8_gemm_flops_per_s, 'FLOP/s')}" if c.fp8_gemm_flops_per_s else "")
        + f"): {bound.bound_s:.3g} s = prefill "
        f"{bound.prefill_s:.3g} s + decode {bound.decode_s:.3g} s over {bound.num_steps:,} steps "
        f"({bound.num_memory_bound_steps:,} memory-bound), {bound.serial_bound_s:.3g} s with each step's weight "
        f"and attention phases in series; model {format_rate(setup.shape.num_params, '')} params, "
        f"{format_rate(setup.shape.weight_bytes_for(0), 'B')} of weights read every step"
        + (
            f" + {format_rate(setup.shape.expert_bytes, 'B')} per routed expert touched "
            f"({setup.shape.num_experts} in each of {setup.shape.num_moe_layers} layers), "
            if setup.shape.num_experts
            else ", "
        )
        + f"{setup.shape.kv_bytes_per_token / 1024:.4g} KiB of KV cache per token"
    )


def engine_args_summary(engine_args: EngineArgs) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(engine_args).items() if v is not None}
