"""A CUDA-IPC weight update of an 8B-shaped bf16 model (dummy weights,
benchmarks/configs/llama-3.1-8b) from a second process on the same GPU: this process is the
trainer, holding every tensor on the GPU, and the engine's core runs in its own process. Reports
the seconds of `update_weights_from_tensors` (best and median of a few, after one warm-up) and
their share of the device copy rate measured in the same run (a copy of the same bytes, one
device-to-device `copy_`); the goal is at most 0.5 s for 16 GB. An update copies the bytes twice
(packing the trainer's bucket, then each parameter from it), so a share of 0.5 is the ceiling.

    python3 tests/gpu/rl_ipc_bench.py [--bucket-mib 512] [--repeats 3] [--output $OUT/rl_ipc.json]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DEFAULT_CONFIG = ROOT / "benchmarks" / "configs" / "llama-3.1-8b"
GOAL_S_PER_16_GB = 0.5


def trainer_weights(config_dir: Path) -> dict:
    """Every tensor of the transformers model for `config_dir`, bf16 on the GPU, small random values."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    weights = {}
    for name, param in meta.named_parameters():
        weights[name] = torch.empty(param.shape, dtype=torch.bfloat16, device="cuda").uniform_(-1e-3, 1e-3)
    return weights


def copy_seconds(num_bytes: int, repeats: int) -> float:
    """The best time of one device-to-device copy of `num_bytes`."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    import torch

    from shoal import LLM

    weights = trainer_weights(args.model)
    num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    copy_s = copy_seconds(num_bytes, args.repeats)
    llm = LLM(
        str(args.model),
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=2048,
        max_num_seqs=16,
        kv_cache_memory_bytes=2 << 30,
    )
    bucket_bytes = args.bucket_mib << 20
    update_s = []
    for i in range(args.repeats + 1):  # the first warms up (the engine's shape table, IPC mappings)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.update_weights_from_tensors(weights, weight_version=f"bench-{i}", bucket_bytes=bucket_bytes)
        update_s.append(time.perf_counter() - start)
    llm.shutdown()
    best = min(update_s[1:])
    result = {
        "model": args.model.name,
        "num_tensors": len(weights),
        "gb": num_bytes / 1e9,
        "bucket_mib": args.bucket_mib,
        "warm_up_s": update_s[0],
        "update_s_best": best,
        "update_s_median": statistics.median(update_s[1:]),
        "update_gb_per_s": num_bytes / best / 1e9,
        "copy_gb_per_s": num_bytes / copy_s / 1e9,
        "share_of_copy_rate": copy_s / best,
        "s_per_16_gb": best * 16e9 / num_bytes,
        "goal_met": best * 16e9 / num_bytes <= GOAL_S_PER_16_GB,
        "device": torch.cuda.get_device_name(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
