"""Workloads: the nano-vllm protocol, fixed lengths, and the truncated ShareGPT file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.bench.workloads import (
    first_exchange,
    fixed_lengths,
    random_nano,
    read_sharegpt_records,
    sharegpt_requests,
)


def test_nano_protocol_is_nano_vllms() -> None:
    workload = random_nano(vocab_size=151936)
    assert len(workload.requests) == 256
    assert all(100 <= r.prompt_len <= 1024 and 100 <= r.output_len <= 1024 for r in workload.requests)
    assert all(0 <= t <= 10000 for r in workload.requests for t in r.prompt_token_ids)
    assert workload.temperature == 0.6 and workload.seed == 0
    # nano-vllm's README reports 133,966 output tokens for this protocol: the same draws.
    assert workload.num_output_tokens == 133966
    assert [r.prompt_len for r in workload.requests[:3]] == [964, 724, 484]
    assert random_nano(vocab_size=151936).requests == workload.requests  # deterministic
    assert random_nano(vocab_size=151936, seed=1).requests != workload.requests


def test_nano_protocol_on_a_small_vocabulary() -> None:
    workload = random_nano(vocab_size=384, num_requests=8)
    assert len(workload.requests) == 8
    assert max(t for r in workload.requests for t in r.prompt_token_ids) < 384


def test_fixed_lengths() -> None:
    workload = fixed_lengths(5, input_len=7, output_len=3, vocab_size=50, seed=2)
    assert [(r.prompt_len, r.output_len) for r in workload.requests] == [(7, 3)] * 5
    assert workload.num_input_tokens == 35 and workload.num_output_tokens == 15
    assert workload.describe()["input_len"] == {"min": 7, "mean": 7.0, "max": 7}
    with pytest.raises(ValueError, match="input_len"):
        fixed_lengths(1, input_len=0, output_len=3, vocab_size=50)


def _turns(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"from": who, "value": text} for who, text in pairs]


def write_truncated_sharegpt(path: Path) -> None:
    """Five records, the last one cut off mid-string (as the packaged file is)."""
    records = [
        {
            "id": "a",
            "conversations": _turns(("human", "Hello world! This is a test."), ("gpt", "The quick brown fox.")),
        },
        {"id": "b", "conversations": _turns(("gpt", "I speak first."), ("human", "Hello."))},
        {"id": "c", "conversations": _turns(("human", "Nobody answers me."))},
        {"id": "d", "conversations": _turns(("human", "one two three four five"), ("gpt", "six seven eight nine ten"))},
    ]
    text = json.dumps(records, indent=2)[:-2]  # drop the closing "\n]"
    torn = json.dumps({"id": "e", "conversations": _turns(("human", "cut"), ("gpt", "never finished"))}, indent=2)
    path.write_text(text + ",\n" + torn[: len(torn) // 2 + 20])


def test_sharegpt_reader_keeps_complete_records(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    write_truncated_sharegpt(path)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    records = list(read_sharegpt_records(path))
    assert [r["id"] for r in records] == ["a", "b", "c", "d"]
    exchanges = [first_exchange(r) for r in records]
    assert exchanges[1] is None and exchanges[2] is None
    assert exchanges[3] == ("one two three four five", "six seven eight nine ten")


def test_sharegpt_requests(tmp_path: Path, tiny_checkpoints: dict[str, Path]) -> None:
    from shoal.frontend.tokenizer import get_tokenizer

    path = tmp_path / "sharegpt.json"
    write_truncated_sharegpt(path)
    tokenizer = get_tokenizer(str(tiny_checkpoints["llama"]))
    workload = sharegpt_requests(tokenizer, num_requests=10, max_model_len=512, path=path)
    assert len(workload.requests) == 2  # the two human → gpt exchanges
    for request in workload.requests:
        assert request.prompt_token_ids == list(tokenizer.encode(request.prompt))
    replies = {
        "Hello world! This is a test.": "The quick brown fox.",
        "one two three four five": "six seven eight nine ten",
    }
    for request in workload.requests:
        assert request.output_len == len(tokenizer.encode(replies[request.prompt], add_special_tokens=False))
    with pytest.raises(ValueError, match="fits"):
        sharegpt_requests(tokenizer, num_requests=10, max_model_len=8, path=path)
    with pytest.raises(ValueError, match="tokenizer"):
        sharegpt_requests(None, num_requests=10, max_model_len=512, path=path)


def test_sharegpt_copy_requests(tmp_path: Path, tiny_checkpoints: dict[str, Path]) -> None:
    """Speculative decoding's copy-heavy workload: each prompt asks to repeat a reply."""
    from shoal.bench.workloads import COPY_PROMPT
    from shoal.frontend.tokenizer import get_tokenizer

    path = tmp_path / "sharegpt.json"
    write_truncated_sharegpt(path)
    tokenizer = get_tokenizer(str(tiny_checkpoints["llama"]))
    workload = sharegpt_requests(tokenizer, num_requests=10, max_model_len=512, path=path, temperature=0.0, copy=True)
    assert workload.name == "sharegpt-copy" and workload.temperature == 0.0
    prompts = {r.prompt for r in workload.requests}
    assert prompts == {COPY_PROMPT.format(reply) for reply in ("The quick brown fox.", "six seven eight nine ten")}
