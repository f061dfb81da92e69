"""Reasoning parsers on small servers of tiny random checkpoints: `--reasoning-parser deepseek_r1`
(the prompt opens the thinking) on a tokenizer with `<think>` and `</think>` as single tokens,
`--reasoning-parser qwen3` (the model opens it, or answers at once) on such a tokenizer and on one
without them. The thinking comes back as `reasoning_content` (whole or streamed); a constraint
(a JSON schema, a choice, a regex, a forced tool call) applies to the answer, never to the
thinking, and never lets unconstrained text through as the answer."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
OK_TOOL: Any = {"type": "function", "function": {"name": "report", "parameters": SCHEMA}}


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


# ---- qwen3: the model opens its thinking itself, or answers at once -----------------------------

CONSTRAINTS: dict[str, Any] = {
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA}}},
    "guided_choice": {"extra_body": {"guided_choice": ["yes", "no"]}},
    "guided_regex": {"extra_body": {"guided_regex": "[ab]{3}"}},
    "required_tool": {"tools": [OK_TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    "named_tool": {"tools": [OK_TOOL], "tool_choice": {"type": "function", "function": {"name": "report"}}},
}


def assert_constrained(kind: str, message: Any) -> None:
    """The message is the answer the constraint asked for, all of it content (or a call)."""
    assert message.reasoning_content is None
    if kind == "json_schema":
        jsonschema.validate(json.loads(message.content), SCHEMA)
    elif kind == "guided_choice":
        assert message.content in ("yes", "no")
    elif kind == "guided_regex":
        assert re.fullmatch("[ab]{3}", message.content)
    else:
        [call] = message.tool_calls
        assert call.function.name == "report" and not message.content
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


@pytest.fixture(scope="module")
def qwen3_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """`--reasoning-parser qwen3` on a tokenizer with `<think>` and `</think>` as single tokens,
    and on one without them (as the demo model's), where no thinking is possible."""
    root = tmp_path_factory.mktemp("qwen3")
    servers: dict[str, ServerProcess] = {}
    try:
        for name, extra_tokens in (("think_tokens", ("<think>", "</think>")), ("no_think_tokens", ())):
            path = make_checkpoint("llama", root / name, extra_tokens=extra_tokens)
            args = [str(path), "--max-model-len", "256", "--reasoning-parser", "qwen3", "--stats-interval", "0"]
            servers[name] = ServerProcess(args, root / f"{name}.log")
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def token_of(server: ServerProcess, text: str) -> int:
    import httpx

    [token] = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return token


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("tokenizer", ["think_tokens", "no_think_tokens"])
def test_qwen3_an_output_without_thinking_is_constrained(
    qwen3_servers: dict[str, ServerProcess], tokenizer: str, kind: str
) -> None:
    """A model that does not open its thinking (`<think>` biased away, or not a token at all)
    writes the constrained answer from its first token, however likely `</think>` is."""
    server = qwen3_servers[tokenizer]
    bias = {}
    if tokenizer == "think_tokens":
        bias = {str(token_of(server, "<think>")): -100, str(token_of(server, "</think>")): 4}
    for seed in range(3):
        response = server.client().chat.completions.create(
            model=server.model_name,
            messages=[{"role": "user", "content": "one two three"}],
            max_tokens=80,  # a call is ~50 tokens of this small vocabulary
            temperature=1.0,
            seed=seed,
            logit_bias=bias,
            **CONSTRAINTS[kind],
        )
        assert response.choices[0].finish_reason in ("stop", "tool_calls")
        assert_constrained(kind, response.choices[0].message)


def test_qwen3_thinking_then_a_constrained_answer(qwen3_servers: dict[str, ServerProcess]) -> None:
    """`<think>` is allowed beside the grammar's tokens at the first token only: a model that
    takes it thinks freely until `</think>`, then answers under the schema (made likely by a
    logit_bias on both markers; some seeds answer at once, some think)."""
    server = qwen3_servers["think_tokens"]
    think, think_end = token_of(server, "<think>"), token_of(server, "</think>")
    thought = None
    for seed in range(4):
        kwargs: Any = dict(
            model=server.model_name,
            messages=[{"role": "user", "content": "one two three"}],
            max_tokens=64,
            temperature=1.0,
            seed=seed,
            logit_bias={str(think): 6, str(think_end): 6},
            **CONSTRAINTS["json_schema"],
        )
        message = server.client().chat.completions.create(**kwargs).choices[0].message
        jsonschema.validate(json.loads(message.content or ""), SCHEMA)
        if message.reasoning_content:
            assert "</think>" not in message.reasoning_content
            thought = kwargs, message
    assert thought is not None, "no seed thought"
    kwargs, message = thought
    reasoning, content = "", ""
    for chunk in server.client().chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


# A chat template that closes the thinking in the prompt, as Qwen3's does with enable_thinking off.
THINKING_OFF_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "assistant: <think>\n\n</think>\n\n"
)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_prompt_that_closed_the_thinking_is_answered_at_once(
    qwen3_servers: dict[str, ServerProcess], reasoning_server: ServerProcess, parser: str
) -> None:
    """The template closed the thinking: the grammar applies from the first token (a `<think>`
    the model favours cannot come out) and the whole output is content."""
    server = qwen3_servers["think_tokens"] if parser == "qwen3" else reasoning_server
    response = server.client().chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "one two three"}],
        max_tokens=40,
        temperature=0,
        logit_bias={str(token_of(server, "<think>")): 100},
        extra_body={"chat_template": THINKING_OFF_TEMPLATE},
        **CONSTRAINTS["json_schema"],
    )
    assert_constrained("json_schema", response.choices[0].message)


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
