"""`shoal bench serve` against a real `shoal serve` of a tiny checkpoint, and its metrics."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.bench.serve import RequestRecord, summarize_load
from shoal.cli import main
from tests.entrypoints.server_utils import ServerProcess


@pytest.fixture(scope="module")
def tiny_server(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("bench_server") / "server.log"
    args = [str(tiny_checkpoints["llama"]), "--kv-cache-memory-bytes", "64MiB", "--stats-interval", "0"]
    process = ServerProcess(args, log_path)
    yield process
    process.stop()


def _bench(tmp_path: Path, server: ServerProcess, flags: str) -> dict:
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", server.url, *flags.split(), "--output-json", str(out)]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_bench_serve_reports_metrics(tmp_path: Path, tiny_server: ServerProcess) -> None:
    report = _bench(tmp_path, tiny_server, "--num-prompts 12 --input-len 24 --output-len 8 --request-rate 100")
    assert report["benchmark"] == "serve" and report["model"] == tiny_server.model_name
    (run,) = report["runs"]
    assert (run["completed"], run["failed"], run["request_rate"]) == (12, 0, 100.0)
    assert run["num_output_tokens"] == 12 * 8 and run["num_input_tokens"] == 12 * 24
    assert run["requests_per_s"] > 0 and run["output_tokens_per_s"] > 0
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms"):
        stats = run[metric]
        assert all(math.isfinite(stats[k]) and stats[k] > 0 for k in ("mean", "p50", "p90", "p99")), metric
    assert run["ttft_ms"]["p50"] < run["latency_ms"]["p50"]


def test_bench_serve_sweep_writes_a_plot(tmp_path: Path, tiny_server: ServerProcess) -> None:
    pytest.importorskip("matplotlib")
    flags = "--num-prompts 6 --input-len 16 --output-len 4 --sweep max-concurrency --sweep-values 1 3"
    report = _bench(tmp_path, tiny_server, flags)
    assert [r["max_concurrency"] for r in report["runs"]] == [1, 3]
    assert all(r["completed"] == 6 for r in report["runs"])
    plot = tmp_path / "serve.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summarize_load_by_hand() -> None:
    fast = RequestRecord(prompt_len=10, output_len=5, ok=True, ttft_s=0.1, itl_s=[0.1] * 4, latency_s=0.5)
    fast.num_output_tokens = 5
    slow = RequestRecord(prompt_len=10, output_len=5, ok=True, ttft_s=0.3, itl_s=[0.2] * 4, latency_s=1.1)
    slow.num_output_tokens = 5
    failed = RequestRecord(prompt_len=10, output_len=5, error="HTTP 400: too long")
    summary = summarize_load([fast, slow, failed], duration_s=2.0)
    assert (summary["completed"], summary["failed"], summary["errors"]) == (2, 1, ["HTTP 400: too long"])
    assert summary["requests_per_s"] == 1.0 and summary["output_tokens_per_s"] == 5.0
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0) and summary["ttft_ms"]["p50"] == pytest.approx(200.0)
    # TPOT = (latency - TTFT) / (tokens - 1): 100 ms and 200 ms.
    assert summary["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert summary["itl_ms"]["p99"] == pytest.approx(200.0) and summary["itl_ms"]["p50"] == pytest.approx(150.0)
