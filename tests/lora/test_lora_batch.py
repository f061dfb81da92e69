"""`shoal batch --enable-lora --lora-modules name=path`: each line's `body.model` chooses the
adapter (greedy equal to transformers + peft), the base model's name the base, an unknown name
the server's 404."""

from __future__ import annotations

import json

from shoal.cli import main as shoal_main
from tests.lora.adapters import make_adapter, peft_greedy

PROMPT = [5, 17, 42, 99, 7]


def test_batch_lines_choose_adapters_by_model(tiny_checkpoints: dict, tmp_path) -> None:
    base = tiny_checkpoints["llama"]
    adapter = make_adapter(base, tmp_path / "adapter", seed=31)
    lines = []
    for custom_id, model in [("lora", "tuned"), ("base", str(base)), ("unknown", "other")]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
        body["return_token_ids"] = True
        lines.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model", str(base)]
    argv += ["--enable-lora", "--lora-modules", f"tuned={adapter}", "--disable-progress-bar"]
    assert shoal_main(argv) == 0
    results = {
        r["custom_id"]: r["response"] for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    }
    assert results["unknown"]["status_code"] == 404
    tuned = results["lora"]["body"]["choices"][0]["token_ids"]
    assert tuned == peft_greedy(base, adapter, PROMPT, 5)
    assert results["base"]["body"]["choices"][0]["token_ids"] != tuned
