"""`shoal bench throughput` and `shoal bench latency` end to end on CPU: a tiny checkpoint, and a
folder holding only a config.json (dummy weights, no tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.cli import main

# A small CPU KV cache keeps start-up fast; one step fits every prompt of these workloads.
ENGINE = ["--device", "cpu", "--kv-cache-memory-bytes", "64MiB"]


def _run(tmp_path: Path, benchmark: str, model: Path, flags: str) -> dict:
    out = tmp_path / "report.json"
    assert main(["bench", benchmark, "--model", str(model), *flags.split(), *ENGINE, "--output-json", str(out)]) == 0
    return json.loads(out.read_text())


def _check_throughput(result: dict, num_requests: int, input_len: int, output_len: int) -> None:
    assert result["num_requests"] == num_requests
    assert result["num_input_tokens"] == num_requests * input_len
    assert result["num_output_tokens"] == num_requests * output_len
    assert result["requests_per_s"] > 0 and result["elapsed_s"] > 0
    rate = result["output_tokens_per_s"]
    assert rate == pytest.approx(result["num_output_tokens"] / result["elapsed_s"])
    assert result["total_tokens_per_s"] == pytest.approx(result["input_tokens_per_s"] + rate)
    assert 0 < result["achieved_share_of_bound"] < 1.5


def test_throughput_tiny_checkpoint(tmp_path: Path, tiny_checkpoints: dict[str, Path], capsys) -> None:
    model = tiny_checkpoints["llama"]
    report = _run(tmp_path, "throughput", model, "--in-process --num-prompts 12 --input-len 20 --output-len 6")
    assert report["benchmark"] == "throughput"
    assert report["workload"]["num_requests"] == 12 and report["workload"]["num_output_tokens"] == 72
    assert list(report["results"]) == ["shoal"]
    _check_throughput(report["results"]["shoal"], 12, 20, 6)
    bound = report["bound"]
    assert bound["bound_s"] == pytest.approx(bound["prefill_s"] + bound["decode_s"]) and bound["num_steps"] == 1 + 5
    assert report["hardware"]["ceilings"]["device"] == "cpu" and report["hardware"]["model"]["num_params"] > 0
    assert report["engine_args"]["model"] == str(model)
    printed = capsys.readouterr().out
    assert "requests/s" in printed and "hardware bound on cpu" in printed


def test_throughput_config_only_folder(tmp_path: Path, config_only_model: Path) -> None:
    """Dummy weights from config.json alone, and no tokenizer."""
    from shoal.frontend.tokenizer import get_tokenizer

    assert get_tokenizer(str(config_only_model)) is None
    flags = "--load-format dummy --in-process --num-prompts 8 --input-len 16 --output-len 4"
    report = _run(tmp_path, "throughput", config_only_model, flags)
    _check_throughput(report["results"]["shoal"], 8, 16, 4)
    assert report["engine_args"]["load_format"] == "dummy"


def test_throughput_both_backends_report_a_ratio(tmp_path: Path, tiny_checkpoints: dict[str, Path]) -> None:
    flags = "--in-process --backend both --num-prompts 6 --input-len 12 --output-len 5 --hf-batch-size 4"
    report = _run(tmp_path, "throughput", tiny_checkpoints["qwen3"], flags + " --no-hardware-bound")
    assert set(report["results"]) == {"shoal", "hf"}
    for result in report["results"].values():
        assert result["num_output_tokens"] == 30 and result["achieved_share_of_bound"] is None
    assert report["results"]["hf"]["hf_batches"] == 2
    ratio = report["results"]["shoal"]["output_tokens_per_s"] / report["results"]["hf"]["output_tokens_per_s"]
    assert report["shoal_vs_hf"] == pytest.approx(ratio) and report["shoal_vs_hf"] > 0
    assert report["bound"] is None


def test_latency_tiny_checkpoint(tmp_path: Path, tiny_checkpoints: dict[str, Path]) -> None:
    flags = "--in-process --batch-size 2 --input-len 8 --output-len 5 --num-iters 3 --num-iters-warmup 1"
    report = _run(tmp_path, "latency", tiny_checkpoints["llama"], flags)
    assert report["benchmark"] == "latency"
    result = report["results"]["shoal"]
    assert result["num_iters"] == 3 and len(result["raw_s"]["ttft"]) == 3
    for metric in ("ttft_ms", "decode_ms_per_token", "total_ms"):
        stats = result[metric]
        assert set(stats) >= {"mean", "p50", "p90", "p99"}
        assert 0 < stats["min"] <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    ttft, total = result["raw_s"]["ttft"], result["raw_s"]["total"]
    per_token = sorted((t - f) / 4 * 1e3 for t, f in zip(total, ttft))
    assert result["decode_ms_per_token"]["p50"] == pytest.approx(per_token[1])
    bound = report["bound"]
    assert 0 < bound["ttft_s"] < bound["total_s"] and bound["decode_s_per_token"] > 0
    assert set(result["achieved_share_of_bound"]) == {"ttft", "decode_per_token", "total"}


def test_latency_both_backends_on_a_config_only_folder(tmp_path: Path, config_only_model: Path) -> None:
    flags = "--load-format dummy --in-process --backend both --batch-size 2 --input-len 8 --output-len 4"
    flags += " --num-iters 2 --num-iters-warmup 1 --temperature 0 --no-hardware-bound"
    report = _run(tmp_path, "latency", config_only_model, flags)
    assert set(report["results"]) == {"shoal", "hf"}
    assert report["shoal_vs_hf"]["decode_per_token"] > 0 and report["shoal_vs_hf"]["ttft"] > 0


def test_a_request_longer_than_the_model_is_a_usage_error(tiny_checkpoints: dict[str, Path], capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "bench",
                "throughput",
                "--model",
                str(tiny_checkpoints["llama"]),
                "--input-len",
                "500",
                "--output-len",
                "100",
                *ENGINE,
            ]
        )
    assert exit_info.value.code == 2
    assert "max_model_len" in capsys.readouterr().err


def test_bench_without_a_benchmark_prints_help(capsys) -> None:
    assert main(["bench"]) == 2
    assert "throughput" in capsys.readouterr().out


def test_throughput_with_a_json_schema_on_every_request(
    tmp_path: Path, config_only_model: Path, tiny_checkpoints: dict[str, Path], capsys
) -> None:
    """Dummy weights from a config-only folder, the tokenizer given apart (as for the 8B shape):
    the constrained run generates exactly the unconstrained run's tokens, and the slowdown is
    reported."""
    tokenizer = tiny_checkpoints["qwen3"]
    flags = f"--load-format dummy --tokenizer {tokenizer} --in-process --num-prompts 6 --input-len 12 --output-len 8"
    report = _run(tmp_path, "throughput", config_only_model, flags + " --structured-output both")
    assert list(report["results"]) == ["shoal", "shoal+json-schema"]
    for result in report["results"].values():
        _check_throughput(result, 6, 12, 8)
    slowdown = report["json_schema_slowdown"]
    assert slowdown == pytest.approx(
        report["results"]["shoal+json-schema"]["elapsed_s"] / report["results"]["shoal"]["elapsed_s"] - 1
    )
    assert "a JSON schema on every request" in capsys.readouterr().out
