"""The sampler's two paths on one GPU: the general path (float32 logits, temperature, softmax,
exponential race) against the one-pass Gumbel-max kernel, on the nano-vllm protocol's batches
(temperature 0.6, vocabularies of Llama-3 and Qwen3), timed like benchmarks/bench_kernels.py.

    python3 benchmarks/bench_sampling.py [--output sampling.json] [--sweep-chunks]

--sweep-chunks also times the kernel with each row split into 1, 2, 4, ... 32 chunks (the
automatic choice is `choose_num_chunks`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import time_per_call

from shoal.sampling_params import SamplingParams
from shoal.workers.input_batch import RequestState
from shoal.workers.sampler import build_sampling_metadata, processed_probs, sample_from_probs

CASES = [(1, 128256), (8, 128256), (64, 151936), (256, 151936)]  # (rows, vocab)


CHUNKS = (1, 2, 4, 8, 16, 32)


def time_case(rows: int, vocab: int, sweep_chunks: bool) -> dict:
    from shoal.kernels.triton.sampling import triton_gumbel_sample

    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    states = [RequestState(str(i), i, 1, SamplingParams(temperature=0.6), None, None) for i in range(rows)]
    md = build_sampling_metadata(states, vocab, torch.device("cuda"))
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    general_ms = time_per_call(lambda i: sample_from_probs(processed_probs(logits.float(), md), {}))
    fused_ms = time_per_call(lambda i: triton_gumbel_sample(out, logits, md.temperature, i))
    result = {"rows": rows, "vocab": vocab, "general_us": 1e3 * general_ms, "fused_us": 1e3 * fused_ms}
    if sweep_chunks:
        result["fused_us_by_chunks"] = {
            c: 1e3 * time_per_call(lambda i, c=c: triton_gumbel_sample(out, logits, md.temperature, i, num_chunks=c))
            for c in CHUNKS
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output")
    parser.add_argument("--sweep-chunks", action="store_true")
    args = parser.parse_args()
    results = []
    for rows, vocab in CASES:
        r = time_case(rows, vocab, args.sweep_chunks)
        results.append(r)
        print(f"rows {rows:4d} vocab {vocab}: general {r['general_us']:8.1f} us, one pass {r['fused_us']:7.1f} us")
        for chunks, us in r.get("fused_us_by_chunks", {}).items():
            print(f"    {chunks:3d} chunks per row: {us:7.1f} us")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
