"""tests/gpu/bench_suite.py's steps that exist for the GPU only, on CPU with `--smoke`: ShareGPT
serving (a tiny model with its own tokenizer, a few ShareGPT exchanges, offline and then over HTTP
at the same concurrency), the runs at vLLM's batching limits, and the host-work benchmark
(`benchmarks/bench_host_step.py`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("bench_suite.py")
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "seven",
    "small",
    "birds",
    "sing",
    "in",
    "the",
    "tall",
    "trees",
]


def test_sharegpt_step_compares_served_with_offline(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    stage = tmp_path / "sharegpt"
    shutil.copytree(tiny_checkpoints["llama"], stage / "tokenizer")
    records = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": " ".join(WORDS[i % 5 : i % 5 + 6 + i % 7])},
                {"from": "gpt", "value": " ".join(WORDS[: 4 + i % 9])},
            ],
        }
        for i in range(20)
    ]
    (stage / "sharegpt.json").write_text(json.dumps(records))
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--smoke", str(tiny_checkpoints["llama"])]
    command += ["--only", "sharegpt", "--sharegpt-dir", str(stage)]
    env = {**os.environ, "SHOAL_CPU_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((out / "smoke_sharegpt_c4.json").read_text())
    offline, served = report["offline"], report["served"]
    assert report["workload"]["num_requests"] == served["completed"] == 12 and served["failed"] == 0
    assert served["num_output_tokens"] == report["workload"]["num_output_tokens"] == offline["num_output_tokens"]
    assert report["served_over_offline"] == served["output_tokens_per_s"] / offline["output_tokens_per_s"] > 0
    assert served["ttft_ms"]["p50"] > 0 and served["itl_ms"]["p99"] >= served["itl_ms"]["p50"] > 0


def test_wide_batching_step_runs_at_its_own_limits(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--smoke", str(tiny_checkpoints["llama"])]
    command += ["--only", "llama8b_wide"]
    env = {**os.environ, "SHOAL_CPU_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for name in ("smoke_wide_nano", "smoke_wide_16x32x8"):
        report = json.loads((out / f"{name}.json").read_text())
        assert report["engine_args"]["max_num_seqs"] == 32
        assert report["engine_args"]["max_num_batched_tokens"] == 512
        result = report["results"]["shoal"]
        assert result["num_output_tokens"] == report["workload"]["num_output_tokens"] > 0


def test_host_step_times_every_phase(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--smoke", str(tiny_checkpoints["llama"])]
    command += ["--only", "host_step"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((out / "host_step.json").read_text())
    assert report["config"]["num_requests"] == 16 and report["config"]["num_steps"] == 30
    phases = report["phases"]
    names = ("schedule", "update_from_output", "input_batch_update", "prepare_inputs", "sampling_metadata", "result")
    assert set(phases) == {*names, "total"}
    assert all(p["p50_us"] > 0 for p in phases.values())
    assert phases["total"]["mean_us"] >= max(p["mean_us"] for name, p in phases.items() if name != "total")
    assert "all host work us/step p50" in done.stdout
