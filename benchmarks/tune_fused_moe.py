"""Tune the fused-MoE kernels' launch configurations for one model shape on this GPU and write
the table the engine reads (shoal/kernels/triton/fused_moe_config.py).

For each batch size of the table's grid it searches the launches of the gate_up GEMM and of the
down GEMM (random routing, the model's top_k), per row-block size BLOCK_SIZE_M (shared by both,
as one alignment pads for both), and keeps the fastest pair. Candidates that do not
compile or fit in shared memory are skipped. A table holds every launch a run may pick, so the
engine compiles them all at start-up and never inside a timed run.

    python benchmarks/tune_fused_moe.py --model benchmarks/configs/qwen3-30b-a3b [--tp 2 | --ep 2]
        [--dtype bfloat16] [--search local|quick|full|decode] [--out-dir shoal/kernels/triton/fused_moe_configs]
    python benchmarks/tune_fused_moe.py --model ... --heuristic   # the heuristic's table, no GPU
    python benchmarks/tune_fused_moe.py --model ... --update --token-counts 192 256   # re-tune a few

`--search local` (the default) climbs from the table's current launch (the heuristic's without a
table): it times the launches one step away on one parameter, moves to the fastest, and stops
when none is faster; BLOCK_SIZE_M tries the current value and its neighbours. It times about a
third of what the `quick` grid does, which is what lets a few batch sizes fit one short GPU
session; the grids (`quick`, `full`, `decode`) search wider.

--max-seconds stops the search early: batch sizes not reached keep their launch (the file's with
--update, else the heuristic's).
The written file is named E={experts},N={intermediate per rank},device_name={gpu},dtype={dtype}.json;
a JSON summary (per batch size: the chosen launch, its time and the table's entry before) goes to
--summary. A batch size keeps its entry when the new launch is less than 3% faster.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shoal.kernels.triton.fused_moe_config import (  # noqa: E402
    CONFIG_DIR,
    TOKEN_COUNTS,
    MoEGemmConfig,
    MoELaunch,
    config_file_name,
    device_name,
    heuristic_launch,
)
from shoal.layers.moe.routing import num_routed_experts  # noqa: E402


@dataclass(frozen=True)
class MoEShape:
    """One rank's experts: `num_experts` of [2 * intermediate, hidden] and [hidden, intermediate]."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int


def shape_of(model_dir: str, tp: int, ep: int) -> MoEShape:
    """The MoE layer shape of one rank: experts split by --ep, their intermediate size by --tp."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    intermediate = int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
    num_experts = num_routed_experts(config)
    if num_experts % ep or intermediate % tp:
        raise SystemExit(f"{num_experts} experts / ep={ep} or intermediate {intermediate} / tp={tp} does not divide")
    return MoEShape(num_experts // ep, int(config.num_experts_per_tok), int(config.hidden_size), intermediate // tp)


# The values `local` steps through, per parameter of a GEMM's launch and for BLOCK_SIZE_M.
AXES = {
    "block_size_n": (32, 64, 128, 256),
    "block_size_k": (32, 64, 128, 256),
    "group_size_m": (1, 8, 16),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4, 5),
}
BLOCK_M_AXIS = (16, 32, 64, 128)


def neighbours(config: MoEGemmConfig) -> list[MoEGemmConfig]:
    """The launches one step away from `config` on one parameter's axis."""
    found = []
    for field, values in AXES.items():
        value = getattr(config, field)
        if value not in values:
            continue  # a value off the axis (a hand-written table) stays as it is
        i = values.index(value)
        found += [dataclasses.replace(config, **{field: values[j]}) for j in (i - 1, i + 1) if 0 <= j < len(values)]
    return found


def climb(time_of: Callable[[MoEGemmConfig], float], start: MoEGemmConfig, max_moves: int = 8) -> list[Timed]:
    """Hill-climb from `start`: every timing taken, as (microseconds, launch)."""
    timed = {start: time_of(start)}
    current = start
    for _ in range(max_moves):
        for config in neighbours(current):
            if config not in timed:
                timed[config] = time_of(config)
        fastest = min(timed, key=lambda c: timed[c])
        if fastest == current:
            break
        current = fastest
    return [(micros, config) for config, micros in timed.items()]


def block_m_neighbours(block_m: int) -> list[int]:
    if block_m not in BLOCK_M_AXIS:
        return [block_m]
    i = BLOCK_M_AXIS.index(block_m)
    return [BLOCK_M_AXIS[j] for j in (i - 1, i, i + 1) if 0 <= j < len(BLOCK_M_AXIS)]


def candidates(search: str) -> tuple[list[int], list[MoEGemmConfig]]:
    """(BLOCK_SIZE_M values, GEMM launches) to time."""
    if search == "full":
        block_m, block_n, block_k = [16, 32, 64, 128], [32, 64, 128, 256], [64, 128, 256]
        groups, warps, stages = [1, 8, 16], [4, 8], [2, 3, 4, 5]
    elif search == "decode":  # weight-bound batches (a few rows an expert): no L2 grouping, 4 warps
        block_m, block_n, block_k = [16, 32, 64], [32, 64, 128], [64, 128, 256]
        groups, warps, stages = [1], [4], [3, 4, 5]
    else:
        block_m, block_n, block_k = [16, 32, 64, 128], [64, 128, 256], [64, 128]
        groups, warps, stages = [1, 16], [4, 8], [3, 4]
    gemms = [
        MoEGemmConfig(n, k, g, w, s) for n, k, g, w, s in itertools.product(block_n, block_k, groups, warps, stages)
    ]
    return block_m, gemms


class Case:
    """Random inputs of one batch size, aligned once per BLOCK_SIZE_M."""

    def __init__(self, shape: MoEShape, num_tokens: int, dtype: torch.dtype) -> None:
        from shoal.kernels.moe_align_block_size import moe_align_block_size

        self._align = moe_align_block_size
        self.shape, self.num_tokens = shape, num_tokens
        device = torch.device("cuda")
        e, h, i = shape.num_experts, shape.hidden, shape.intermediate
        self.x = torch.randn(num_tokens, h, device=device, dtype=dtype)
        self.w13 = torch.randn(e, 2 * i, h, device=device, dtype=dtype) * h**-0.5
        self.w2 = torch.randn(e, h, i, device=device, dtype=dtype) * i**-0.5
        scores = torch.rand(num_tokens, e, device=device)
        self.topk_ids = scores.topk(shape.top_k, dim=-1).indices
        self.weights = torch.rand(num_tokens * shape.top_k, device=device)
        entries = num_tokens * shape.top_k
        self.activated = torch.randn(entries, i, device=device, dtype=dtype)
        self.down = torch.empty(entries, h, device=device, dtype=dtype)
        self._routing: dict[int, tuple[torch.Tensor, ...]] = {}

    def routing(self, block_m: int) -> tuple[torch.Tensor, ...]:
        if block_m not in self._routing:
            self._routing[block_m] = self._align(self.topk_ids, self.shape.num_experts, block_m)
        return self._routing[block_m]

    def time_gemm(self, which: str, block_m: int, config: MoEGemmConfig) -> float:
        """Microseconds of one launch of the gate_up GEMM (with the activation) or the down GEMM;
        inf when it does not run."""
        import triton

        from shoal.kernels.triton.fused_moe import invoke_moe_gate_up, invoke_moe_gemm

        routing = self.routing(block_m)
        x, weights, top_k = self.x, self.weights, self.shape.top_k

        def launch() -> None:
            if which == "gate_up":
                invoke_moe_gate_up(x, self.w13, self.activated, routing, top_k, block_m, config)
            else:
                invoke_moe_gemm(self.activated, self.w2, self.down, weights, routing, True, block_m, config)

        try:
            return 1e3 * triton.testing.do_bench(launch, warmup=5, rep=25)
        except Exception as exc:  # out of resources, a compile error: not a candidate
            if "out of resource" not in str(exc).lower() and "shared memory" not in str(exc).lower():
                print(f"  skipped {which} BLOCK_SIZE_M={block_m} {config}: {type(exc).__name__}: {exc}"[:300])
            return float("inf")


# A launch already in the table wins over a new one this close to the fastest: each distinct
# launch is one more kernel the engine compiles at start-up.
REUSE_TOLERANCE = 0.03


Timed = tuple[float, MoEGemmConfig]
# How one GEMM's candidates get timed: (which GEMM, time_of) -> timings.
Search = Callable[[str, Callable[[MoEGemmConfig], float]], list[Timed]]


def grid_search(gemms: list[MoEGemmConfig]) -> Search:
    return lambda which, time_of: [(time_of(g), g) for g in gemms]


def local_search(start: MoELaunch) -> Search:
    return lambda which, time_of: climb(time_of, getattr(start, which))


def pick(timed: list[Timed], known: set[MoEGemmConfig]) -> Timed:
    """The fastest candidate, or a known one within REUSE_TOLERANCE of it."""
    best = min(timed, key=lambda t: t[0])
    reusable = [t for t in timed if t[1] in known and t[0] <= best[0] * (1 + REUSE_TOLERANCE)]
    return min(reusable, key=lambda t: t[0]) if reusable else best


def tune_one(case: Case, block_ms: list[int], search: Search, known: set[MoEGemmConfig]) -> tuple[MoELaunch, float]:
    """The fastest (launch, microseconds of both GEMMs) for one batch size."""
    best: tuple[MoELaunch, float] | None = None
    rows_per_expert = case.num_tokens * case.shape.top_k / case.shape.num_experts
    for block_m in block_ms:
        if block_m > 16 and block_m > 4 * max(rows_per_expert, 1):
            continue  # mostly padding: never the fastest
        timed = {w: pick(search(w, functools.partial(case.time_gemm, w, block_m)), known) for w in ("gate_up", "down")}
        total = timed["gate_up"][0] + timed["down"][0]
        if best is None or total < best[1]:
            best = (MoELaunch(block_m, timed["gate_up"][1], timed["down"][1]), total)
    assert best is not None
    known.update((best[0].gate_up, best[0].down))
    return best


def time_launch(case: Case, launch: MoELaunch) -> float:
    return case.time_gemm("gate_up", launch.block_size_m, launch.gate_up) + case.time_gemm(
        "down", launch.block_size_m, launch.down
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a folder with the model's config.json")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (splits the intermediate size)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (splits the experts)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--search", default="local", choices=("local", "quick", "full", "decode"))
    parser.add_argument("--token-counts", type=int, nargs="*", default=list(TOKEN_COUNTS))
    parser.add_argument("--out-dir", default=str(CONFIG_DIR))
    parser.add_argument("--device-name", default=None, help="the GPU name in the file name (default: this GPU's)")
    parser.add_argument("--heuristic", action="store_true", help="write the heuristic's table without timing")
    parser.add_argument("--max-seconds", type=float, default=480.0)
    parser.add_argument("--summary", default=None, help="write a JSON summary here")
    parser.add_argument(
        "--update", action="store_true", help="keep the shape's table file and re-tune only --token-counts"
    )
    args = parser.parse_args()

    shape = shape_of(args.model, args.tp, args.ep)
    device = args.device_name or (device_name(torch.device("cuda")) if torch.cuda.is_available() else "cpu")
    path = Path(args.out_dir) / config_file_name(shape.num_experts, shape.intermediate, device, args.dtype)
    # --update re-tunes --token-counts and keeps the rest: the file's entries, or without a file
    # the heuristic's for the whole grid (a table of the tuned counts alone would serve a batch of
    # one with the launch tuned for hundreds of tokens).
    grid = sorted({*args.token_counts, *TOKEN_COUNTS}) if args.update else args.token_counts
    table = {count: heuristic_launch(count, shape.num_experts, shape.top_k) for count in grid}
    kept: dict[int, MoELaunch] = {}
    if args.update and path.exists():
        kept = {int(count): MoELaunch.from_json(entry) for count, entry in json.loads(path.read_text()).items()}
        table = {**table, **kept}  # batch sizes the search does not reach keep their launch
    summary: dict[str, dict] = {}
    if not args.heuristic:
        start = time.perf_counter()
        grid = None if args.search == "local" else candidates(args.search)
        dtype, known = getattr(torch, args.dtype), set[MoEGemmConfig]()
        known.update(g for launch in kept.values() for g in (launch.gate_up, launch.down))
        for count in args.token_counts:
            if time.perf_counter() - start > args.max_seconds:
                print(f"--max-seconds reached: {count} tokens and the counts after it keep their launch")
                break
            case = Case(shape, count, dtype)
            current = table[count]  # the file's entry with --update, else the heuristic's
            if grid is None:
                block_ms, search = block_m_neighbours(current.block_size_m), local_search(current)
            else:
                block_ms, search = grid[0], grid_search(grid[1])
            launch, micros = tune_one(case, block_ms, search, known)
            current_micros = time_launch(case, current)
            if current != launch and current_micros <= micros * (1 + REUSE_TOLERANCE):
                launch, micros = current, current_micros  # not worth another kernel to compile
            table[count] = launch
            summary[str(count)] = {"launch": launch.to_json(), "us": micros, "current_us": current_micros}
            print(f"{count:6d} tokens: {micros:9.1f} us (current {current_micros:9.1f} us)  {launch}", flush=True)
            del case
            torch.cuda.empty_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f'  "{count}": {json.dumps(launch.to_json())}' for count, launch in sorted(table.items())]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one batch size a line
    print(f"wrote {path}")
    if args.summary:
        Path(args.summary).write_text(
            json.dumps({"shape": shape.__dict__, "device": device, "table": summary}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
