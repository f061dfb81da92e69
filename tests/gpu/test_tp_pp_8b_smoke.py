"""tests/gpu/tp_pp_8b.py (the 2-GPU TP/PP check) on CPU with `--smoke`: the same steps on a tiny
Llama shape through the session's Ray cluster (gloo), in float32, where TP=2 and PP=2 must give
exactly TP=1's tokens. Runs the script as the GPU machine does, in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().with_name("tp_pp_8b.py")


def test_tp_pp_check_runs_every_layout_and_matches_tp1(
    ray_cluster: dict, tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--checkpoint", str(checkpoint)]
    command += ["--smoke", str(tiny_checkpoints["llama"])]
    env = {**os.environ, "SHOAL_CPU_THREADS": "1", "OMP_NUM_THREADS": "1"}  # RAY_ADDRESS: the session's cluster
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    # The checkpoint: several shards, an index naming each tensor's shard, the config beside them.
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert (checkpoint / "config.json").exists()

    summary = json.loads((out / "tp_pp_8b_summary.json").read_text())
    assert summary["passed"] and not summary["failures"]
    for name in ("tp2", "pp2", "tp1_batch1"):
        comparison = summary["comparison_with_tp1"][name]
        assert comparison["num_equal"] == comparison["num_prompts"] == 8
        assert comparison["mean_leading_equal_tokens"] == 16
        assert comparison["max_abs_logprob_diff"] < 1e-3
    reports = {name: json.loads((out / f"tp_pp_8b_{name}.json").read_text()) for name in ("tp1", "tp2", "pp2")}
    tokens = {name: report["greedy"][name]["tokens"] for name, report in reports.items()}
    assert tokens["tp1"] == tokens["tp2"] == tokens["pp2"]
    assert all(len(t) == 16 for t in tokens["tp1"]) and len(set(map(tuple, tokens["tp1"]))) > 1
    for name, report in reports.items():
        # The `shoal bench throughput` report, with the layout beside it.
        layout = report["layout"]
        assert (layout["tensor_parallel_size"], layout["pipeline_parallel_size"]) == {
            "tp1": (1, 1),
            "tp2": (2, 1),
            "pp2": (1, 2),
        }[name]
        assert report["benchmark"] == "throughput" and report["engine_args"]["device"] == "cpu"
        result = report["results"]["shoal"]
        assert result["num_requests"] == 8 and result["num_output_tokens"] == 8 * 8
        assert result["output_tokens_per_s"] > 0 and result["total_tokens_per_s"] > 0
        assert result["achieved_share_of_bound"] > 0
    assert (out / "tp_pp_8b_summary.txt").read_text().startswith("summary")
