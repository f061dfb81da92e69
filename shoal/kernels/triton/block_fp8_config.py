"""Launch configurations of the block-fp8 GEMM (shoal/kernels/triton/w8a8_block_fp8_matmul.py),
chosen ahead of time per shape and number of tokens, the way fused_moe_config.py chooses the
fused-MoE kernel's.

A table is a JSON file in block_fp8_configs/ named after the weight's shape, the GPU and the
block shape, `N={N},K={K},device_name={gpu},dtype=fp8_w8a8,block_shape=[{block_n},{block_k}].json`,
mapping a number of tokens M to a launch:

    {"64": {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 3}, ...}

A batch of M tokens takes the entry whose token count is nearest M. BLOCK_SIZE_K is always
block_k: each K step of the kernel meets one group of the activations' scales. Without a table
for the shape `heuristic_launch` fills one in over TOKEN_COUNTS: narrow row tiles while the
GEMM is weight-bound (decode), square tiles with L2 grouping once rows are many (prefill).
So the set of kernels a run can launch is fixed, and `warm_up_token_counts` (shared with the
fused-MoE tables) gives one batch size per distinct launch for the engine to compile at start-up.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from shoal.kernels.triton.fused_moe_config import TOKEN_COUNTS

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).with_name("block_fp8_configs")


@dataclass(frozen=True)
class BlockFp8Launch:
    block_size_m: int
    block_size_n: int
    group_size_m: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def to_json(self) -> dict[str, int]:
        return {
            "BLOCK_SIZE_M": self.block_size_m,
            "BLOCK_SIZE_N": self.block_size_n,
            "GROUP_SIZE_M": self.group_size_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }

    @classmethod
    def from_json(cls, entry: dict[str, int]) -> BlockFp8Launch:
        return cls(
            block_size_m=int(entry["BLOCK_SIZE_M"]),
            block_size_n=int(entry["BLOCK_SIZE_N"]),
            group_size_m=int(entry.get("GROUP_SIZE_M", 1)),
            num_warps=int(entry.get("num_warps", 4)),
            num_stages=int(entry.get("num_stages", 3)),
        )


def config_file_name(n: int, k: int, device: str, block_size: tuple[int, int]) -> str:
    return f"N={n},K={k},device_name={device},dtype=fp8_w8a8,block_shape=[{block_size[0]},{block_size[1]}].json"


def heuristic_launch(num_tokens: int) -> BlockFp8Launch:
    if num_tokens <= 16:
        return BlockFp8Launch(16, 64, 1, 4, 4)
    if num_tokens <= 64:
        return BlockFp8Launch(32, 64, 1, 4, 4)
    if num_tokens <= 256:
        return BlockFp8Launch(64, 128, 8, 4, 3)
    return BlockFp8Launch(128, 128, 8, 8, 3)


@functools.cache
def launch_table(n: int, k: int, device: str, block_size: tuple[int, int]) -> dict[int, BlockFp8Launch]:
    """token count -> launch, from the shape's file when there is one, else the heuristic."""
    path = CONFIG_DIR / config_file_name(n, k, device, block_size)
    if path.exists():
        logger.info("block-fp8 GEMM launch configurations from %s", path.name)
        return {int(count): BlockFp8Launch.from_json(entry) for count, entry in json.loads(path.read_text()).items()}
    return {count: heuristic_launch(count) for count in TOKEN_COUNTS}


def nearest_launch(table: dict[int, BlockFp8Launch], num_tokens: int) -> BlockFp8Launch:
    return table[min(table, key=lambda count: (abs(count - num_tokens), count))]
