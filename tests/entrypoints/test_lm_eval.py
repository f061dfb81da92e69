"""lm-eval's `local-chat-completions` against `shoal serve` gives the same accuracy as lm-eval's
own `hf` model on the same folder (the demo model), on a small local generate task (40
capitals, greedy; the answer is the capitalized words that end the reply). Slow (two lm-eval runs, transformers generating on the CPU) and it needs the
`eval` extra (`pip install 'lm-eval[api]'`):

    python -m pytest -m slow tests/entrypoints/test_lm_eval.py -s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.server_utils import ServerProcess

pytestmark = pytest.mark.slow
TASK_DIR = Path(__file__).parent / "lm_eval_task"


def _task_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir()
    template = (TASK_DIR / "shoal_capitals.yaml.in").read_text()
    (folder / "shoal_capitals.yaml").write_text(template.replace("@DATA@", str(TASK_DIR / "capitals.jsonl")))
    return folder


def _lm_eval(tmp_path: Path, name: str, model: str, model_args: str, *flags: str) -> dict:
    out = tmp_path / name
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [
        sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
        "--include_path", str(tmp_path / "tasks"),
        "--tasks", "shoal_capitals", "--apply_chat_template", "--output_path", str(out), "--log_samples", *flags,
    ]  # fmt: skip
    subprocess.run(command, check=True, env=env, timeout=1800)
    [results] = list(out.rglob("results_*.json"))
    [samples] = list(out.rglob("samples_shoal_capitals_*.jsonl"))
    responses = [json.loads(line)["filtered_resps"][0] for line in samples.read_text().splitlines()]
    return {
        "accuracy": json.loads(results.read_text())["results"]["shoal_capitals"]["exact_match,strip"],
        "responses": responses,
    }


def test_chat_completions_accuracy_equals_hf(demo_model_path: str, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    _task_folder(tmp_path)
    server = ServerProcess(
        [demo_model_path, "--max-model-len", "1024", "--stats-interval", "0"], tmp_path / "server.log"
    )
    try:
        url = f"{server.url}/v1/chat/completions"
        args = f"model={server.model_name},base_url={url},num_concurrent=4,max_retries=1,tokenized_requests=False"
        shoal = _lm_eval(tmp_path, "shoal", "local-chat-completions", args)
    finally:
        server.stop()
    hf = _lm_eval(tmp_path, "hf", "hf", f"pretrained={demo_model_path},dtype=float32", "--batch_size", "8")
    print(f"\nlm-eval shoal_capitals exact_match: shoal {shoal['accuracy']:.3f}, hf {hf['accuracy']:.3f}")
    assert shoal["accuracy"] == hf["accuracy"]
    assert shoal["accuracy"] > 0.2  # the demo model knows some capitals: the task measures something
