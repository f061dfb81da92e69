"""`LLM.start_profile` / `stop_profile`: torch.profiler runs where the model runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from shoal import LLM, SamplingParams, envs

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The quick brown fox", "one two three four"]


def test_profile_is_taken_in_the_engine_process(tiny_checkpoints: dict, tmp_path: Path) -> None:
    with LLM(str(tiny_checkpoints["llama"])) as llm:
        llm.start_profile(str(tmp_path / "traces"))
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        [summary] = llm.stop_profile()
    assert summary["rank"] == 0 and summary["wall_s"] > 0
    assert summary["device_busy_s"] is None  # a CPU worker has no device timeline
    assert "aten::" in summary["table"]
    trace = Path(summary["trace"])
    assert trace.parent == tmp_path / "traces"
    events = json.loads(trace.read_text())["traceEvents"]
    ops = [e for e in events if str(e.get("name", "")).startswith("aten::")]
    assert any(e["name"] in ("aten::mm", "aten::addmm", "aten::linear") for e in ops)  # the model ran in it
    assert os.getpid() not in {e.get("pid") for e in ops}  # in the engine-core process, not this one


def test_profile_directory_from_the_environment_and_misuse(
    tiny_checkpoints: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with LLM(str(tiny_checkpoints["llama"]), multiprocess=False) as llm:
        monkeypatch.setattr(envs, "SHOAL_TORCH_PROFILER_DIR", None)
        with pytest.raises(ValueError, match="SHOAL_TORCH_PROFILER_DIR"):
            llm.start_profile()
        with pytest.raises(ValueError, match="no profile is running"):
            llm.stop_profile()
        monkeypatch.setattr(envs, "SHOAL_TORCH_PROFILER_DIR", str(tmp_path / "from-env"))
        llm.start_profile()
        with pytest.raises(ValueError, match="already running"):
            llm.start_profile()
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        [summary] = llm.stop_profile()
        assert Path(summary["trace"]).parent == tmp_path / "from-env" and Path(summary["trace"]).stat().st_size > 0
        assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving
