"""`shoal bench throughput --num-loras N`: random adapters in PEFT's layout written for the model
(benchmarks/make_lora_adapters.py writes the same files), requests spread evenly over them."""

from __future__ import annotations

import json
from pathlib import Path

from shoal.cli import main
from shoal.lora.peft_checkpoint import load_adapter


def test_throughput_spread_over_adapters(tmp_path: Path, tiny_checkpoints: dict[str, Path]) -> None:
    model = tiny_checkpoints["llama"]
    out, lora_dir = tmp_path / "report.json", tmp_path / "loras"
    flags = "--in-process --num-prompts 8 --input-len 12 --output-len 4 --no-hardware-bound --num-loras 3"
    flags += f" --lora-rank 8 --lora-dir {lora_dir} --max-loras 2 --device cpu --kv-cache-memory-bytes 64MiB"
    assert main(["bench", "throughput", "--model", str(model), *flags.split(), "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_loras"] == 3 and report["results"]["shoal"]["num_output_tokens"] == 8 * 4
    assert sorted(p.name for p in lora_dir.iterdir()) == ["adapter_0", "adapter_1", "adapter_2"]
    adapter = load_adapter("a", lora_dir / "adapter_0", max_lora_rank=8, num_layers=3)
    assert adapter.rank == 8 and len(adapter.modules) == 3 * 7  # every projection of every layer
