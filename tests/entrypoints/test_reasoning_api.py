"""`--reasoning-parser deepseek_r1` on a small server of a tiny random checkpoint whose tokenizer
has `</think>` as one token: the thinking comes back as `reasoning_content` (whole or streamed),
and a JSON schema constrains the answer after it, not the thinking."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.checkpoints import make_checkpoint
from tests.entrypoints.server_utils import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("reasoning")
    path = make_checkpoint("llama", root / "model", extra_tokens=("<think>", "</think>"))
    process = ServerProcess(
        [str(path), "--max-model-len", "256", "--reasoning-parser", "deepseek_r1", "--stats-interval", "0"],
        root / "server.log",
    )
    yield process
    process.stop()


def end_of_thinking(server: ServerProcess) -> int:
    import httpx

    [token] = httpx.post(f"{server.url}/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()[
        "tokens"
    ]
    return token


def test_thinking_then_a_constrained_answer(reasoning_server: ServerProcess) -> None:
    """A random model thinks until it happens on `</think>` (made likely by a logit_bias, which
    the grammar overrides once the answer begins); the answer then follows the schema."""
    client = reasoning_server.client()
    think_end = end_of_thinking(reasoning_server)
    kwargs = dict(
        model=reasoning_server.model_name,
        messages=[{"role": "user", "content": "one two three"}],
        max_tokens=48,
        temperature=1.0,
        seed=2,
        logit_bias={str(think_end): 4.0},
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}},
    )
    message = client.chat.completions.create(**kwargs).choices[0].message  # type: ignore[call-overload]
    assert message.reasoning_content and "</think>" not in message.reasoning_content
    jsonschema.validate(json.loads(message.content or ""), SCHEMA)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        if chunk.choices:
            reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_thinking_that_never_ends_is_all_reasoning(reasoning_server: ServerProcess) -> None:
    client: openai.OpenAI = reasoning_server.client()
    think_end = end_of_thinking(reasoning_server)
    choice = client.chat.completions.create(
        model=reasoning_server.model_name,
        messages=[{"role": "user", "content": "one"}],
        max_tokens=8,
        temperature=0,
        logit_bias={str(think_end): -100},
    ).choices[0]
    assert choice.message.content is None and choice.message.reasoning_content and choice.finish_reason == "length"


def test_make_checkpoint_keeps_its_vocabulary(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = make_checkpoint("llama", tmp_path / "m", extra_tokens=("</think>",))
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 384 and len(tokenizer.encode("</think>", add_special_tokens=False)) == 1


def test_include_reasoning_false_leaves_the_thinking_out(reasoning_server: ServerProcess) -> None:
    """vLLM's `include_reasoning: false`: the thinking is still split off the content, and not sent."""
    client: openai.OpenAI = reasoning_server.client()
    think_end = end_of_thinking(reasoning_server)
    kwargs = dict(
        model=reasoning_server.model_name,
        messages=[{"role": "user", "content": "one"}],
        max_tokens=6,
        temperature=0,
        logit_bias={str(think_end): -100},
    )
    shown = client.chat.completions.create(**kwargs).choices[0].message  # type: ignore[call-overload]
    assert shown.reasoning_content
    hidden = client.chat.completions.create(extra_body={"include_reasoning": False}, **kwargs)  # type: ignore[call-overload]
    assert hidden.choices[0].message.reasoning_content is None and hidden.choices[0].message.content is None
    stream = client.chat.completions.create(stream=True, extra_body={"include_reasoning": False}, **kwargs)  # type: ignore[call-overload]
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert not any(getattr(delta, "reasoning_content", None) for delta in deltas)
    assert not any(delta.content for delta in deltas)
