"""Issue 4's GPU must-show on 2 GPUs: tensor and pipeline parallelism on an 8B-shaped model give
TP=1's greedy tokens, and each layout's throughput is measured beside TP=1's.

1. The checkpoint, made once: benchmarks/configs/llama-3.1-8b/config.json with random bf16
   weights (seed 0; normal with std 0.02, norm weights 1), drawn on the GPU tensor by tensor in
   the order of transformers' state dict and saved as ~4 GB safetensors shards with an index
   (/tmp/shoal-8b; skipped when its index exists). Every layout loads these same weights.
2. For each layout, TP1 (one GPU, the uniproc executor), TP2 and PP2 (Ray, one worker a GPU),
   in its own engine, shut down before the next starts:
   - 32 prompts of random token ids (seed 1, lengths 16-256), greedy for 16 tokens
     (`ignore_eos`), in one batch, with the sampled tokens' logprobs;
   - TP1 only: the same prompts again one at a time (prefix cache reset first), the noise floor:
     how far bf16 rounding alone (other GEMM shapes) moves TP1's own tokens;
   - the throughput of 256 x (512 in, 128 out) through `shoal bench throughput`'s functions.
   Each layout's report (the `shoal bench throughput` JSON, plus its greedy tokens and timings)
   is written to --out as soon as the layout finishes.
3. The comparison with TP1 (summary JSON and a table, printed last, also after a failure or an
   interrupt): per layout the prompts whose 16 tokens all equal TP1's (count and fraction), the
   mean number of leading tokens equal, the prompts whose first token is equal, and the mean and
   largest logprob difference over the positions where both contexts are still equal; and the
   same for the noise floor, beside which each layout is placed (`against_noise_floor`).
   Random weights in bf16 make long greedy runs chaotic (a 2-layer proxy of this shape on CPU:
   TP2 7/16 prompts equal, TP1 one at a time 10/16, the same logprob differences), so the bar is
   the issue's: most prompts equal (more than half); the floor says how much of a miss is
   rounding. A sharding bug shows as unequal first tokens and logprob differences far above the
   floor's.

PP2 runs without CUDA graphs (by design); its hardware bound is one GPU's (the bound's model
divides only by the tensor-parallel size).

Exit status 0 only when every layout ran and met the bar.

    python3 tests/gpu/tp_pp_8b.py --out $OUT                      # on 2 GPUs (run_tp_pp_8b.sh)
    .venv/bin/python tests/gpu/tp_pp_8b.py --out /tmp/smoke --smoke TINY_MODEL_DIR   # CPU, tiny
    (tests/gpu/test_tp_pp_8b_smoke.py runs the smoke through Ray on CPU.)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shoal.bench import hardware, throughput  # noqa: E402
from shoal.bench.common import OfflineSetup, prepare_offline  # noqa: E402
from shoal.bench.report import format_table, print_lines, write_json  # noqa: E402
from shoal.bench.workloads import BenchRequest, fixed_lengths, random_token_ids  # noqa: E402
from shoal.config import EngineArgs  # noqa: E402

INDEX_NAME = "model.safetensors.index.json"
# layout -> (tensor_parallel_size, pipeline_parallel_size); TP1 first: the others compare to it.
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
REFERENCE = "tp1"
NOISE_FLOOR = "tp1_batch1"


@dataclass(frozen=True)
class Plan:
    """The checkpoint, the engine settings and the workload sizes of one run."""

    config_dir: Path  # holds the config.json of the model shape
    checkpoint: Path
    dtype: str
    device: str
    init_std: float
    shard_bytes: int
    max_model_len: int
    num_prompts: int
    prompt_lens: tuple[int, int]  # min, max
    num_greedy_tokens: int
    throughput: tuple[int, int, int]  # requests, input len, output len
    layout_timeout_s: int
    max_num_batched_tokens: int | None = None
    weight_seed: int = 0
    prompt_seed: int = 1


H200_X2 = Plan(
    config_dir=ROOT / "benchmarks" / "configs" / "llama-3.1-8b",
    checkpoint=Path("/tmp/shoal-8b"),
    dtype="bfloat16",
    device="cuda",
    init_std=0.02,
    shard_bytes=4 * 10**9,
    max_model_len=4096,  # as BENCHMARKS.md's TP=1 runs
    num_prompts=32,
    prompt_lens=(16, 256),
    num_greedy_tokens=16,
    throughput=(256, 512, 128),
    layout_timeout_s=170,
)


def smoke_plan(config_dir: Path, checkpoint: Path) -> Plan:
    """The same steps on CPU: a tiny shape, float32 (so every layout's tokens are equal), shards
    small enough that there are several, chunked prefills."""
    return Plan(
        config_dir=config_dir,
        checkpoint=checkpoint,
        dtype="float32",
        device="cpu",
        init_std=0.2,  # as tests/checkpoints.py: greedy generation is not degenerate
        shard_bytes=256 << 10,
        max_model_len=256,
        num_prompts=8,
        prompt_lens=(4, 40),
        num_greedy_tokens=16,
        throughput=(8, 32, 8),
        layout_timeout_s=120,
        max_num_batched_tokens=64,
    )


class LayoutTimeout(Exception):
    """A layout ran past its share of the time (SIGALRM)."""


# ---- 1. the checkpoint --------------------------------------------------------------------------


def ensure_checkpoint(plan: Plan) -> None:
    """Random weights of the config's shape as a sharded safetensors checkpoint, made once."""
    if (plan.checkpoint / INDEX_NAME).exists():
        print_lines(f"checkpoint {plan.checkpoint} exists: reused")
        return
    import torch

    start = time.perf_counter()
    shapes = hf_parameter_shapes(plan.config_dir)
    dtype = getattr(torch, plan.dtype)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    shards = plan_shards(shapes, element_bytes, plan.shard_bytes)
    partial = plan.checkpoint.with_name(f"{plan.checkpoint.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weight_map = write_shards(plan, shapes, shards, dtype, partial)
    total_bytes = sum(math.prod(s) for s in shapes.values()) * element_bytes
    index = {
        "metadata": {"total_size": total_bytes, "seed": plan.weight_seed, "init_std": plan.init_std},
        "weight_map": weight_map,
    }
    (partial / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    shutil.copy(plan.config_dir / "config.json", partial / "config.json")
    shutil.rmtree(plan.checkpoint, ignore_errors=True)  # a folder left without its index
    os.replace(partial, plan.checkpoint)
    if plan.device == "cuda":
        torch.cuda.empty_cache()
    print_lines(
        f"checkpoint {plan.checkpoint}: {len(shapes)} tensors, {total_bytes / 1e9:.2f} GB in {len(shards)} "
        f"shards, made in {time.perf_counter() - start:.1f} s"
    )


def hf_parameter_shapes(config_dir: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor a transformers checkpoint of this config holds (the model
    built on the meta device: no memory), in state-dict order."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)  # saved once, as the embedding
    return shapes


def plan_shards(shapes: dict[str, tuple[int, ...]], element_bytes: int, shard_bytes: int) -> list[list[str]]:
    """Consecutive tensors grouped into shards of at most `shard_bytes` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        num_bytes = math.prod(shape) * element_bytes
        if shards[-1] and size + num_bytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += num_bytes
    return shards


def write_shards(
    plan: Plan, shapes: dict[str, tuple[int, ...]], shards: list[list[str]], dtype: Any, folder: Path
) -> dict[str, str]:
    """Draw every tensor on the plan's device (one generator, fixed order) and save the shards;
    returns the index's weight map."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator(device=plan.device).manual_seed(plan.weight_seed)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        start = time.perf_counter()
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_weight(name, shapes[name], dtype, plan, generator).cpu() for name in names}
        drawn_s = lap(start)
        save_file(tensors, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file_name))
        num_bytes = sum(t.nbytes for t in tensors.values())
        print_lines(
            f"  {file_name}: {num_bytes / 1e9:.2f} GB, drawn in {drawn_s:.1f} s, saved in {lap(start) - drawn_s:.1f} s"
        )
    return weight_map


def random_weight(name: str, shape: tuple[int, ...], dtype: Any, plan: Plan, generator: Any) -> Any:
    """Matrices normal(0, init_std); norm weights 1 and biases 0, as transformers initializes them."""
    import torch

    if len(shape) == 1:
        fill = 1.0 if name.endswith("norm.weight") else 0.0
        return torch.full(shape, fill, dtype=dtype, device=plan.device)
    return torch.empty(shape, dtype=dtype, device=plan.device).normal_(0.0, plan.init_std, generator=generator)


# ---- 2. the layouts ------------------------------------------------------------------------------


def greedy_prompts(plan: Plan, vocab_size: int) -> list[list[int]]:
    rng = random.Random(plan.prompt_seed)
    low, high = plan.prompt_lens
    return [random_token_ids(rng, rng.randint(low, high), vocab_size) for _ in range(plan.num_prompts)]


def greedy(llm: Any, prompts: list[list[int]], num_tokens: int) -> dict[str, list[list[Any]]]:
    """Greedy tokens of every prompt in one batch, and each sampled token's logprob."""
    from shoal.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, logprobs=0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [
        [position[token].logprob for token, position in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [])]
        for o in outputs
    ]
    return {"tokens": tokens, "logprobs": logprobs}


def greedy_one_at_a_time(llm: Any, prompts: list[list[int]], num_tokens: int) -> dict[str, list[list[Any]]]:
    """The noise floor: the same prompts one request at a time (other GEMM shapes, so other bf16
    rounding), after the prefix cache is reset so that every prompt is computed again."""
    llm.reset_prefix_cache()
    runs = [greedy(llm, [p], num_tokens) for p in prompts]
    return {key: [run[key][0] for run in runs] for key in ("tokens", "logprobs")}


class Run:
    """The whole check: the layouts' reports, the comparison, the summary table."""

    def __init__(self, out: Path, plan: Plan, layouts: list[str]) -> None:
        self.out, self.plan, self.layouts = out, plan, layouts
        self.start = time.perf_counter()
        self.greedy: dict[str, dict[str, list[list[Any]]]] = {}
        self.results: dict[str, dict[str, Any]] = {}  # layout -> throughput result and timings
        self.failures: dict[str, str] = {}
        self.notes: dict[str, str] = {}  # layout -> what happened besides its results
        self.ceilings: hardware.DeviceCeilings | None = None

    def log(self, message: str) -> None:
        print_lines(f"[{time.perf_counter() - self.start:6.1f} s] {message}")

    def engine_args(self, tp: int, pp: int, enforce_eager: bool) -> EngineArgs:
        p = self.plan
        return EngineArgs(
            model=str(p.checkpoint),
            dtype=p.dtype,
            device=p.device,
            max_model_len=p.max_model_len,
            max_num_batched_tokens=p.max_num_batched_tokens,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            enforce_eager=enforce_eager,
        )

    def run_layout(self, name: str, enforce_eager: bool = False) -> None:
        """Start the layout's engine, measure, shut it down, and write its report."""
        tp, pp = LAYOUTS[name]
        setup = prepare_offline(self.engine_args(tp, pp, enforce_eager), measure_bound=False, in_process=False)
        setup.ceilings = self.ceilings
        vocab_size = setup.config.model_config.vocab_size
        prompts = greedy_prompts(self.plan, vocab_size)
        workload = fixed_lengths(*self.plan.throughput, vocab_size)
        setup.check_fits(workload.requests + [BenchRequest(p, self.plan.num_greedy_tokens) for p in prompts])
        wait_for_free_gpus(self.plan.device)
        timings: dict[str, float] = {}
        clock = time.perf_counter()
        llm = setup.create_llm()
        try:
            timings["engine_start_s"] = lap(clock)
            self.log(f"{name}: engine started in {timings['engine_start_s']:.1f} s")
            result = self.measure(llm, name, prompts, workload, timings)
        finally:
            clock = time.perf_counter()
            llm.shutdown()
            timings["shutdown_s"] = lap(clock)
        result["engine_start_s"] = timings["engine_start_s"]
        self.save_layout(name, setup, workload, result, timings)

    def measure(
        self, llm: Any, name: str, prompts: list[list[int]], workload: Any, timings: dict[str, float]
    ) -> dict[str, Any]:
        """Greedy tokens (and, for TP1, the noise floor), then the throughput run's result."""
        num_tokens = self.plan.num_greedy_tokens
        clock = time.perf_counter()
        self.greedy[name] = greedy(llm, prompts, num_tokens)
        timings["greedy_s"] = lap(clock)
        if name == REFERENCE:
            clock = time.perf_counter()
            self.greedy[NOISE_FLOOR] = greedy_one_at_a_time(llm, prompts, num_tokens)
            timings["greedy_one_at_a_time_s"] = lap(clock)
        llm.reset_prefix_cache()
        clock = time.perf_counter()
        result = throughput.run_shoal(llm, workload, llm.config.model_config.vocab_size)
        timings["throughput_s"] = lap(clock)  # its warm-up included
        return result

    def save_layout(self, name: str, setup: OfflineSetup, workload: Any, result: dict, timings: dict) -> None:
        report = throughput.make_report(setup, workload, {"shoal": result})
        tp, pp = LAYOUTS[name]
        report["layout"] = {"name": name, "tensor_parallel_size": tp, "pipeline_parallel_size": pp}
        report["timings_s"] = timings
        shown = [name, NOISE_FLOOR] if name == REFERENCE else [name]
        report["greedy"] = {key: self.greedy[key] for key in shown if key in self.greedy}
        write_json(self.out / f"tp_pp_8b_{name}.json", report)
        throughput.print_report(report, setup)
        self.results[name] = {"result": result, "timings_s": timings}
        self.log(f"{name}: wrote tp_pp_8b_{name}.json ({', '.join(f'{k} {v:.1f}' for k, v in timings.items())})")

    def measure_ceilings(self) -> None:
        clock = time.perf_counter()
        self.ceilings = hardware.measure_ceilings(self.plan.device, self.plan.dtype)
        self.log(f"device ceilings measured in {lap(clock):.1f} s")

    # ---- 3. the comparison and the summary ---------------------------------------------------------

    def comparison(self) -> dict[str, dict[str, Any]]:
        reference = self.greedy.get(REFERENCE)
        if reference is None:
            return {}
        others = [name for name in [NOISE_FLOOR, *LAYOUTS] if name != REFERENCE and name in self.greedy]
        comparison = {name: compare(self.greedy[name], reference) for name in others}
        floor = comparison.get(NOISE_FLOOR)
        for name in others:
            if floor is not None and name != NOISE_FLOOR:
                comparison[name]["against_noise_floor"] = against_floor(comparison[name], floor)
        return comparison

    def summary(self) -> bool:
        """Write the summary JSON and text table; True when every layout ran and met the bar."""
        comparison = self.comparison()
        compared = [name for name in self.layouts if name != REFERENCE]
        passed = not self.failures and all(comparison.get(n, {}).get("most_equal", False) for n in compared)
        summary = {
            "plan": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.plan).items()},
            "criterion": "for each of tp2 and pp2, more than half of the prompts give TP1's first "
            f"{self.plan.num_greedy_tokens} greedy tokens exactly",
            "passed": passed,
            "failures": self.failures,
            "notes": self.notes,
            "comparison_with_tp1": comparison,
            "layouts": self.results,
            "elapsed_s": time.perf_counter() - self.start,
        }
        write_json(self.out / "tp_pp_8b_summary.json", summary)
        table = self.table(comparison)
        (self.out / "tp_pp_8b_summary.txt").write_text(table + "\n")
        print_lines("", table, json.dumps({"passed": passed, "failures": sorted(self.failures)}))
        return passed

    def table(self, comparison: dict[str, dict[str, Any]]) -> str:
        header = ["layout", "equal/prompts", "mean lead eq", "1st tok eq", "|dlogprob| mean", "max", "start s"]
        header += ["output tok/s", "total tok/s", "of bound", "vs tp1"]
        rows = [self.table_row(name, comparison.get(name, {})) for name in [*self.layouts, NOISE_FLOOR]]
        n, i, o = self.plan.throughput
        title = (
            f"summary ({time.perf_counter() - self.start:.0f} s): greedy {self.plan.num_greedy_tokens} tokens of "
            f"{self.plan.num_prompts} prompts vs tp1 ({self.plan.dtype}); throughput {n} x ({i} in, {o} out); "
            f"{NOISE_FLOOR}: tp1 again, one prompt at a time"
        )
        return title + "\n" + format_table(header, rows)

    def table_row(self, name: str, c: dict[str, Any]) -> list[Any]:
        """One layout: its tokens against TP1's (c: `compare`'s answer) and its throughput."""
        result = self.results.get(name, {}).get("result", {})
        reference_rate = self.results.get(REFERENCE, {}).get("result", {}).get("total_tokens_per_s")
        share, rate = result.get("achieved_share_of_bound"), result.get("total_tokens_per_s")
        if c:
            tokens = [
                f"{c['num_equal']}/{c['num_prompts']} ({100 * c['fraction_equal']:.0f}%)",
                c["mean_leading_equal_tokens"],
                f"{c['num_first_token_equal']}/{c['num_prompts']}",
                c["mean_abs_logprob_diff"] if c["mean_abs_logprob_diff"] is not None else "-",
                c["max_abs_logprob_diff"] if c["max_abs_logprob_diff"] is not None else "-",
            ]
        else:
            tokens = ["reference" if name == REFERENCE else "-", "-", "-", "-", "-"]
        return [
            f"{name} (FAILED)" if name in self.failures else (f"{name} (eager)" if name in self.notes else name),
            *tokens,
            result.get("engine_start_s", "-"),
            result.get("output_tokens_per_s", "-"),
            rate if rate is not None else "-",
            f"{100 * share:.1f}%" if share is not None else "-",
            f"{rate / reference_rate:.2f}x" if rate and reference_rate else "-",
        ]


def compare(ours: dict[str, list[list[Any]]], reference: dict[str, list[list[Any]]]) -> dict[str, Any]:
    """How close one layout's greedy tokens are to the reference's, prompt by prompt."""
    leading = [leading_equal(a, b) for a, b in zip(ours["tokens"], reference["tokens"])]
    num_prompts = len(leading)
    num_equal = sum(a == b for a, b in zip(ours["tokens"], reference["tokens"]))
    # Where the tokens so far agree, both predicted from the same context: the logprobs must be close.
    diffs = [
        abs(x - y)
        for lead, xs, ys in zip(leading, ours["logprobs"], reference["logprobs"])
        for x, y in zip(xs[:lead], ys[:lead])
    ]
    return {
        "num_prompts": num_prompts,
        "num_equal": num_equal,
        "fraction_equal": num_equal / num_prompts,
        "most_equal": num_equal > num_prompts / 2,
        "mean_leading_equal_tokens": sum(leading) / num_prompts,
        "num_first_token_equal": sum(lead > 0 for lead in leading),
        "leading_equal_tokens": leading,
        "max_abs_logprob_diff": max(diffs) if diffs else None,
        "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else None,
    }


def against_floor(layout: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    """A layout's distance from TP1 next to TP1's own (one prompt at a time): the prompts equal
    beyond the floor's (negative: fewer), and its mean logprob difference over the floor's."""
    ratio = None
    if layout["mean_abs_logprob_diff"] is not None and floor["mean_abs_logprob_diff"]:
        ratio = layout["mean_abs_logprob_diff"] / floor["mean_abs_logprob_diff"]
    return {"num_equal_minus_floor": layout["num_equal"] - floor["num_equal"], "mean_logprob_diff_over_floor": ratio}


def leading_equal(a: list[int], b: list[int]) -> int:
    """How many tokens at the start of `a` and `b` are equal."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


# ---- plumbing: time, GPUs, Ray -------------------------------------------------------------------------


def lap(start: float) -> float:
    return time.perf_counter() - start


def wait_for_free_gpus(device: str, max_used_bytes: int = 4 << 30, timeout_s: float = 60.0) -> None:
    """Wait until no GPU holds more than `max_used_bytes` (a previous layout's Ray workers free
    their memory only when their processes end, after shutdown returns)."""
    if device != "cuda":
        return
    deadline = time.monotonic() + timeout_s
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    while True:
        used_mib = [int(line) for line in subprocess.run(query, capture_output=True, text=True).stdout.split()]
        if all(u << 20 <= max_used_bytes for u in used_mib) or time.monotonic() > deadline:
            print_lines(f"GPU memory used (MiB): {used_mib}")
            return
        time.sleep(1.0)


def start_ray(device: str) -> bool:
    """One local Ray cluster for every layout, which each engine-core process joins through
    RAY_ADDRESS (token authentication off, as tests/conftest.py's `ray_cluster`). Nothing
    happens when RAY_ADDRESS is set already. True when this process started it."""
    if os.environ.get("RAY_ADDRESS"):
        return False
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    num_cpus = max(os.cpu_count() or 1, 2) if device == "cpu" else None
    context = ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    os.environ["RAY_ADDRESS"] = context.address_info["gcs_address"]
    return True


def stop_engines() -> None:
    """Stop an engine-core process that a failed or interrupted `LLM()` left running."""
    from shoal.frontend import core_client

    core_client._shutdown_live_clients()


def raise_layout_timeout(signum: int, frame: Any) -> None:
    raise LayoutTimeout("the layout ran past its time")


def run_layouts(run: Run, names: list[str]) -> None:
    """Each layout in turn; a failure is recorded and the next one runs. A single-stage GPU
    layout whose engine fails fast (not a timeout) runs again with CUDA graphs off, so that its
    tokens are still compared; the note says so."""
    signal.signal(signal.SIGALRM, raise_layout_timeout)
    for name in names:
        run.log(f"==== {name} (tp x pp = {LAYOUTS[name]}) ====")
        error = run_one(run, name, enforce_eager=False)
        uses_graphs = run.plan.device == "cuda" and LAYOUTS[name][1] == 1
        if error is not None and uses_graphs and not isinstance(error, LayoutTimeout):
            run.notes[name] = f"failed with CUDA graphs on ({type(error).__name__}: {error}); measured eager"
            run.log(f"{name}: {run.notes[name]}")
            error = run_one(run, name, enforce_eager=True)
        if error is not None:
            run.failures[name] = f"{type(error).__name__}: {error}"


def run_one(run: Run, name: str, enforce_eager: bool) -> Exception | None:
    """One layout under its own alarm; the exception that ended it, if any."""
    signal.alarm(run.plan.layout_timeout_s)
    try:
        run.run_layout(name, enforce_eager)
    except KeyboardInterrupt:
        run.failures[name] = "interrupted (out of time)"
        raise
    except Exception as exc:
        traceback.print_exc()
        stop_engines()
        return exc
    finally:
        signal.alarm(0)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, default=None, help="where the checkpoint is made (or found)")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--smoke", type=Path, default=None, help="a folder with a tiny config.json: CPU, tiny")
    parser.add_argument("--layout-timeout-s", type=int, default=None, help="seconds each layout may take")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke is not None:
        plan = smoke_plan(args.smoke, args.checkpoint or args.out / "checkpoint")
    else:
        plan = replace(H200_X2, checkpoint=args.checkpoint or H200_X2.checkpoint)
    if args.layout_timeout_s is not None:
        plan = replace(plan, layout_timeout_s=args.layout_timeout_s)
    run = Run(args.out, plan, args.layouts)
    started_ray = False
    try:
        ensure_checkpoint(plan)
        run.log("checkpoint ready")
        run.measure_ceilings()
        started_ray = start_ray(plan.device)
        run.log(f"Ray cluster at {os.environ['RAY_ADDRESS']}")
        run_layouts(run, args.layouts)
    except KeyboardInterrupt:
        run.failures["run"] = "interrupted (out of time)"
        stop_engines()
    except Exception as exc:
        traceback.print_exc()
        run.failures["run"] = f"{type(exc).__name__}: {exc}"
    finally:
        passed = run.summary()
        if started_ray:
            import ray

            ray.shutdown()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
