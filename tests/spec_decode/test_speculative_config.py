"""`SpeculativeConfig`: vLLM's names and defaults, and a `ValueError` that says what is wrong for
every bad config, before anything loads."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from shoal.config import ModelConfig, ParallelConfig
from shoal.spec_decode.config import SpeculativeConfig


def folder(root: Path, name: str, **config) -> str:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def target(vocab_size: int = 384, hidden_size: int = 64, **hf) -> ModelConfig:
    return ModelConfig(
        model="/models/target",
        tokenizer="/models/target",
        served_model_name="target",
        dtype="float32",
        max_model_len=256,
        hf_config=SimpleNamespace(hidden_size=hidden_size, vocab_size=vocab_size, **hf),
        architecture="LlamaForCausalLM",
        vocab_size=vocab_size,
        seed=0,
    )


def test_ngram_window_defaults_follow_vllm() -> None:
    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=2)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)
    both = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3)
    assert (both.prompt_lookup_min, both.prompt_lookup_max, both.accept_all_drafts) == (1, 3, False)
    assert not both.uses_target_hidden_states and both.drafter_path(target()) is None


def test_model_methods_read_their_folder(tmp_path: Path) -> None:
    head = folder(tmp_path, "head", vocab_size=384, hidden_size=64)
    config = SpeculativeConfig.from_json(
        json.dumps({"method": "eagle3", "num_speculative_tokens": 2, "model": head, "draft_tensor_parallel_size": 1})
    )
    assert config.uses_target_hidden_states and config.drafter_path(target()) == head
    config.validate_against(target(), ParallelConfig(tensor_parallel_size=2))
    mtp = SpeculativeConfig(method="mtp", num_speculative_tokens=1)
    assert mtp.drafter_path(target()) == "/models/target"  # the target's own checkpoint
    mtp.validate_against(target(num_nextn_predict_layers=1))


def test_disable_by_batch_size() -> None:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_batch_size=8)
    assert config.speculates_at(8) and not config.speculates_at(9)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3).speculates_at(10_000)


BAD_JSON = [
    ("not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"num_speculative_tokens": 3}', "needs method"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
    (
        '{"method": "medusa", "num_speculative_tokens": 3}',
        "method must be one of ngram, draft_model, eagle, eagle3, mtp",
    ),
    (
        '{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}',
        "unknown speculative_config key(s) ['lookahead']",
    ),
    ('{"method": "ngram", "num_speculative_tokens": 3, "tensor_parallel_size": 2}', "draft_tensor_parallel_size"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be >= 1, got 0"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens must be an integer"),
    (
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
        "prompt_lookup_min (4) must be <= prompt_lookup_max (2)",
    ),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}', "prompt_lookup_min must be >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "model": "/m"}', "'ngram' takes no model"),
    (
        '{"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}',
        "applies to model-based methods",
    ),
    (
        '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 1}',
        "disable_by_batch_size must be >= 2",
    ),
    (
        '{"method": "ngram", "num_speculative_tokens": 3, "accept_all_drafts": 1}',
        "accept_all_drafts must be true or false",
    ),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs model"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "needs model"),
    (
        '{"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_min": 2}',
        "prompt_lookup_min applies to method 'ngram' only",
    ),
    ('{"method": "draft_model", "num_speculative_tokens": 3, "model": "/no/such/folder"}', "is not a local directory"),
]


@pytest.mark.parametrize(("text", "message"), BAD_JSON)
def test_bad_configs_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        SpeculativeConfig.from_json(text)
    assert message in str(excinfo.value)


def test_a_folder_without_config_json(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        SpeculativeConfig(method="eagle3", num_speculative_tokens=2, model=str(tmp_path / "empty"))


def test_checks_against_the_target(tmp_path: Path) -> None:
    small_vocab = folder(tmp_path, "draft", vocab_size=256, architectures=["LlamaForCausalLM"])
    config = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model=small_vocab)
    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the target's has 384"):
        config.validate_against(target())
    unknown_arch = folder(tmp_path, "gpt2", vocab_size=384, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"draft model architectures \['GPT2LMHeadModel'\] are not supported"):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model=unknown_arch).validate_against(target())
    good = folder(tmp_path, "good", vocab_size=384, architectures=["LlamaForCausalLM"])
    SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model=good).validate_against(target())

    narrow = folder(tmp_path, "narrow", vocab_size=384, hidden_size=32)
    with pytest.raises(ValueError, match="hidden states of width 32, the target's are 64"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2, model=narrow).validate_against(target())
    # An EAGLE-3 head narrower than the target names the target's width: accepted.
    wide_target = folder(tmp_path, "wide", vocab_size=384, hidden_size=32, target_hidden_size=64)
    SpeculativeConfig(method="eagle3", num_speculative_tokens=2, model=wide_target).validate_against(target())

    with pytest.raises(ValueError, match="'mtp' needs multi-token-prediction layers"):
        SpeculativeConfig(method="mtp", num_speculative_tokens=1).validate_against(target(num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="'mtp' needs multi-token-prediction layers"):
        SpeculativeConfig(method="mtp", num_speculative_tokens=1).validate_against(target())

    with pytest.raises(ValueError, match=r"must be 1 or the target's tensor_parallel_size \(4\), got 2"):
        SpeculativeConfig(
            method="eagle", num_speculative_tokens=2, model=good, draft_tensor_parallel_size=2
        ).validate_against(target(), ParallelConfig(tensor_parallel_size=4))


def test_the_config_module_loads_no_torch() -> None:
    """The engine core reads this config, and the engine core loads no torch."""
    import subprocess
    import sys

    code = "import sys, shoal.spec_decode.config; print('torch' in sys.modules, 'numpy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split()[0] == "False"
