"""Launch configurations of the fused-MoE kernels, chosen ahead of time per shape and batch size.

A table is a JSON file in fused_moe_configs/ named after the layer's shape and the GPU,
`E={num_experts},N={intermediate_size},device_name={gpu},dtype={dtype}.json` (N is the experts'
intermediate size on one rank, vLLM's naming), mapping a number of tokens to a launch:

    {"256": {"BLOCK_SIZE_M": 16,
             "gate_up": {"BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 4},
             "down": {...}}, ...}

A batch of n tokens takes the entry whose token count is nearest n. Both GEMMs share
BLOCK_SIZE_M, since one `moe_align_block_size` pads the groups for both. Without a table for
the shape (another GPU, a model nobody tuned) a heuristic on the rows each expert gets fills one
in, with the same token counts; benchmarks/tune_fused_moe.py writes tuned tables.

gate_up's BLOCK_SIZE_N is the width of each of its two products (gate and up, computed together
with the activation by one program).

Because the table is fixed, so is the set of kernels a run can launch: `warm_up_token_counts`
gives one batch size per distinct launch, and the engine compiles them all at start-up.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).with_name("fused_moe_configs")
# The token counts a table holds an entry for (vLLM's tuning grid, extended to 16384).
TOKEN_COUNTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 8192, 16384)


@dataclass(frozen=True)
class MoEGemmConfig:
    """The launch of one grouped GEMM (gate_up or down)."""

    block_size_n: int
    block_size_k: int
    group_size_m: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def to_json(self) -> dict[str, int]:
        return {key.upper() if key.startswith("block") or key.startswith("group") else key: value
                for key, value in asdict(self).items()}  # fmt: skip

    @classmethod
    def from_json(cls, entry: dict[str, int]) -> MoEGemmConfig:
        return cls(
            block_size_n=int(entry["BLOCK_SIZE_N"]),
            block_size_k=int(entry["BLOCK_SIZE_K"]),
            group_size_m=int(entry.get("GROUP_SIZE_M", 1)),
            num_warps=int(entry.get("num_warps", 4)),
            num_stages=int(entry.get("num_stages", 3)),
        )


@dataclass(frozen=True)
class MoELaunch:
    """Both GEMMs of a fused-MoE call at one batch size."""

    block_size_m: int
    gate_up: MoEGemmConfig
    down: MoEGemmConfig

    def to_json(self) -> dict:
        return {"BLOCK_SIZE_M": self.block_size_m, "gate_up": self.gate_up.to_json(), "down": self.down.to_json()}

    @classmethod
    def from_json(cls, entry: dict) -> MoELaunch:
        return cls(
            int(entry["BLOCK_SIZE_M"]),
            MoEGemmConfig.from_json(entry["gate_up"]),
            MoEGemmConfig.from_json(entry["down"]),
        )


@functools.cache
def device_name(device: torch.device) -> str:
    """The GPU's name as table files spell it ("NVIDIA H200" -> "NVIDIA_H200"); "cpu" on CPU."""
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_").replace("-", "_")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_file_name(num_experts: int, intermediate_size: int, device: str, dtype: str) -> str:
    return f"E={num_experts},N={intermediate_size},device_name={device},dtype={dtype}.json"


def heuristic_launch(num_tokens: int, num_experts: int, top_k: int = 8) -> MoELaunch:
    """A launch from the rows each expert gets on average (num_tokens * top_k / num_experts):
    small row blocks and deep K tiles while the GEMMs are weight-bound (decode), large square
    tiles with L2 grouping once each expert has hundreds of rows (prefill). gate_up's tiles are
    half as wide as down's: a gate_up program computes its columns of both the gate and up
    products, so it reads as many weight rows as a down program."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 64:
        block_m = 16 if rows_per_expert <= 16 else 32
        return MoELaunch(block_m, _decode_gemm(32), _decode_gemm(64))
    if rows_per_expert <= 256:
        return MoELaunch(64, _prefill_gemm(64, num_warps=4), _prefill_gemm(128, num_warps=4))
    return MoELaunch(128, _prefill_gemm(64, num_warps=8), _prefill_gemm(128, num_warps=8))


def _decode_gemm(block_size_n: int) -> MoEGemmConfig:
    return MoEGemmConfig(block_size_n=block_size_n, block_size_k=128, group_size_m=1, num_warps=4, num_stages=4)


def _prefill_gemm(block_size_n: int, num_warps: int) -> MoEGemmConfig:
    return MoEGemmConfig(block_size_n=block_size_n, block_size_k=64, group_size_m=8, num_warps=num_warps, num_stages=3)


@functools.cache
def launch_table(num_experts: int, intermediate_size: int, dtype: str, device: str) -> dict[int, MoELaunch]:
    """token count -> launch, from the shape's file when there is one, else the heuristic."""
    path = CONFIG_DIR / config_file_name(num_experts, intermediate_size, device, dtype)
    if path.exists():
        entries = json.loads(path.read_text())
        logger.info("fused MoE launch configurations from %s", path.name)
        return {int(count): MoELaunch.from_json(entry) for count, entry in entries.items()}
    logger.info("no tuned fused MoE table %s: heuristic launch configurations", path.name)
    return {count: heuristic_launch(count, num_experts) for count in TOKEN_COUNTS}


def nearest_launch(table: dict[int, MoELaunch], num_tokens: int) -> MoELaunch:
    """The entry whose token count is nearest `num_tokens` (the smaller on a tie)."""
    return table[min(table, key=lambda count: (abs(count - num_tokens), count))]


@functools.lru_cache(maxsize=4096)
def moe_launch_for(
    num_experts: int, intermediate_size: int, dtype: torch.dtype, device: torch.device, num_tokens: int
) -> MoELaunch:
    """The launch of a batch of `num_tokens` (memoized: eager steps look it up once per layer)."""
    table = launch_table(num_experts, intermediate_size, dtype_name(dtype), device_name(device))
    return nearest_launch(table, num_tokens)


def warm_up_token_counts(table: dict[int, MoELaunch], max_num_tokens: int) -> list[int]:
    """One batch size per distinct launch that batches of 1..max_num_tokens tokens can pick
    (the table's token counts up to max_num_tokens, and max_num_tokens itself, deduplicated by
    the launch they pick)."""
    candidates = sorted({count for count in table if count <= max_num_tokens} | {max_num_tokens})
    chosen: dict[MoELaunch, int] = {}
    for count in candidates:
        chosen.setdefault(nearest_launch(table, count), count)
    return sorted(chosen.values())
