"""The rejection sampler's cost on one GPU, beside the normal sampler's for the same requests:
k drafts a request (k + 1 logits rows), Llama-3's vocabulary, greedy, plain temperature and
top-p batches. Each figure is the wall time of one call, launches and host work included (what
a step pays; neither sampler runs inside a CUDA graph), the median of a few rounds of 50 calls.

    python3 benchmarks/bench_rejection_sampler.py [--output rejection_sampler.json] [--profile]

--profile also prints the torch profiler's busiest operations of one request's verification.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from shoal.sampling_params import SamplingParams
from shoal.spec_decode.draft_layout import DraftLayout
from shoal.spec_decode.rejection_sampler import RejectionSampler, verification_sampling_metadata
from shoal.workers.input_batch import RequestState
from shoal.workers.sampler import Sampler, build_sampling_metadata

VOCAB = 128256
K = 3
MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.6),
    "top_p": SamplingParams(temperature=0.6, top_p=0.9),
}


def wall_ms(fn, calls: int = 50, rounds: int = 5) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return float(np.median(times))


def time_case(num_reqs: int, mode: str, device: torch.device) -> dict:
    params = MODES[mode]
    states = [RequestState(str(i), i, 1, params, None, None) for i in range(num_reqs)]
    drafts = [[1, 2, 3]] * num_reqs
    layout = DraftLayout.of([K] * num_reqs)
    logits = torch.randn(layout.num_rows, VOCAB, device=device, dtype=torch.bfloat16)
    draft_ids = torch.tensor([t for d in drafts for t in d], device=device)
    verify_md = verification_sampling_metadata(states, drafts, VOCAB, device)
    rejection = RejectionSampler(K)
    sample_md = build_sampling_metadata(states, VOCAB, device)
    sampler = Sampler()
    one_row = logits[layout.bonus_rows.tolist()].contiguous()
    return {
        "num_reqs": num_reqs,
        "mode": mode,
        "sampler_ms": wall_ms(lambda: sampler(one_row, sample_md)),
        "rejection_sampler_ms": wall_ms(lambda: rejection(logits, layout, draft_ids, None, verify_md)),
        "rejection_sampler_with_metadata_ms": wall_ms(
            lambda: rejection(
                logits, layout, draft_ids, None, verification_sampling_metadata(states, drafts, VOCAB, device)
            )
        ),
    }


def profile_one_request(mode: str, device: torch.device) -> None:
    states = [RequestState("0", 0, 1, MODES[mode], None, None)]
    layout = DraftLayout.of([K])
    logits = torch.randn(layout.num_rows, VOCAB, device=device, dtype=torch.bfloat16)
    draft_ids = torch.tensor([1, 2, 3], device=device)
    md = verification_sampling_metadata(states, [[1, 2, 3]], VOCAB, device)
    rejection = RejectionSampler(K)
    for _ in range(5):
        rejection(logits, layout, draft_ids, None, md)
    torch.cuda.synchronize()
    with torch.profiler.profile() as prof:
        for _ in range(20):
            rejection(logits, layout, draft_ids, None, md)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def check_against_cpu(device: torch.device) -> None:
    """Greedy chains on the GPU equal the CPU's (the same logits, bf16 -> float32 exact)."""
    torch.manual_seed(0)
    states = [RequestState(str(i), i, 1, MODES["greedy"], None, None) for i in range(16)]
    logits = torch.randn(16 * (K + 1), 1000, dtype=torch.bfloat16)
    drafts = [logits[i * (K + 1) : i * (K + 1) + K].float().argmax(-1).tolist() for i in range(16)]
    for i in range(0, 16, 3):
        drafts[i][i % K] = 999  # some runs cut short
    layout = DraftLayout.of([K] * 16)
    flat = torch.tensor([t for d in drafts for t in d])
    results = []
    for dev in (torch.device("cpu"), device):
        md = verification_sampling_metadata(states, drafts, 1000, dev)
        out = RejectionSampler(K)(logits.to(dev), layout, flat.to(dev), None, md)
        results.append(out.token_ids.cpu())
    assert torch.equal(results[0], results[1]), "greedy verification differs between CPU and GPU"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    check_against_cpu(device)
    results = []
    for num_reqs in (1, 8, 64, 256):
        for mode in MODES:
            r = time_case(num_reqs, mode, device)
            results.append(r)
            print(
                f"reqs {num_reqs:4d} {mode:11s}: sampler {r['sampler_ms']:6.3f} ms, rejection sampler "
                f"{r['rejection_sampler_ms']:6.3f} ms ({K + 1} rows a request; "
                f"{r['rejection_sampler_with_metadata_ms']:6.3f} ms with its metadata built)"
            )
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))
    if args.profile:
        profile_one_request("temperature", device)


if __name__ == "__main__":
    main()
