"""The logic behind vLLM's request fields, without a server: which fields are refused and which
of their values are taken, stream_options' usage, prompt truncation, the cut of prompt logprobs,
the chat template's continue_final_message and add_special_tokens."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from shoal.entrypoints.openai.errors import APIError
from shoal.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from shoal.entrypoints.openai.refused_fields import refused_fields
from shoal.entrypoints.openai.serving import OpenAIServing, prompt_logprobs_of
from shoal.entrypoints.openai.serving_chat import _add_generation_prompt, _echoed
from shoal.frontend.chat import render_chat
from shoal.outputs import Logprob

CHAT = [{"role": "user", "content": "hi"}]
COMPLETION_ONLY = {"suffix", "prompt_embeds"}
CHAT_ONLY = {
    "structural_tag",
    "functions",
    "function_call",
    "audio",
    "modalities",
    "web_search_options",
    "verbosity",
    "media_io_kwargs",
    "max_repetition_pattern_size",
    "min_repetition_pattern_size",
    "repetition_min_count",
}


def parse(route: str, **fields: Any) -> Any:
    if route == "chat":
        return ChatCompletionRequest.model_validate({"messages": CHAT, **fields})
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


def routes_of(name: str) -> list[str]:
    if name in COMPLETION_ONLY:
        return ["completions"]
    return ["chat"] if name in CHAT_ONLY else ["completions", "chat"]


@pytest.mark.parametrize("name", sorted(refused_fields()))
def test_every_refused_field_is_a_400_naming_it(name: str) -> None:
    for route in routes_of(name):
        with pytest.raises(pydantic.ValidationError) as info:
            parse(route, **{name: "something"})
        [error] = info.value.errors()
        assert error["loc"] == (name,) and "not supported by shoal" in error["msg"]
        assert getattr(parse(route, **{name: None}), name) is None  # null asks for nothing


@pytest.mark.parametrize(
    ("name", "value"),
    [("best_of", 1), ("bad_words", []), ("priority", 0), ("priority", 0.0), ("thinking_token_budget", -1)],
)
def test_values_that_ask_for_nothing_are_taken(name: str, value: Any) -> None:
    assert getattr(parse("completions", **{name: value}), name) == value


def test_true_is_not_one() -> None:
    with pytest.raises(pydantic.ValidationError, match="best_of"):
        parse("completions", best_of=True)


@pytest.mark.parametrize(
    ("options", "chunk_usage", "final_usage"),
    [
        ({}, False, False),
        ({"include_usage": True}, False, True),
        ({"continuous_usage_stats": True}, True, True),
        ({"include_usage": False, "continuous_usage_stats": True}, False, False),
        ({"include_usage": True, "continuous_usage_stats": True}, True, True),
    ],
)
def test_stream_options_usage(options: dict[str, bool], chunk_usage: bool, final_usage: bool) -> None:
    parsed = StreamOptions.model_validate(options)
    assert (parsed.chunk_usage, parsed.final_usage) == (chunk_usage, final_usage)


def serving(max_model_len: int) -> OpenAIServing:
    """An OpenAIServing with only what `truncated` reads."""
    server = object.__new__(OpenAIServing)
    server.max_model_len = max_model_len
    return server


@pytest.mark.parametrize(
    ("keep", "side", "max_tokens", "expected"),
    [
        (None, None, 4, list(range(20))),
        (3, None, 4, [17, 18, 19]),
        (3, "left", 4, [17, 18, 19]),
        (3, "right", 4, [0, 1, 2]),
        (30, None, 4, list(range(20))),
        (-1, None, 8, [16, 17, 18, 19]),  # a context of 12: 4 prompt tokens leave room for 8
        (-1, "right", 8, [0, 1, 2, 3]),
        (-1, None, None, list(range(9, 20))),  # no max_tokens: room for one
    ],
)
def test_truncate_prompt_tokens(keep: int | None, side: str | None, max_tokens: int | None, expected: list) -> None:
    request = parse("completions", truncate_prompt_tokens=keep, truncation_side=side)
    assert serving(12).truncated(list(range(20)), request, max_tokens) == expected


def test_prompt_logprobs_keep_the_prompt_token_and_the_top_n() -> None:
    rows = [
        None,
        {7: Logprob(-3.0, 5, "a"), 1: Logprob(-0.1, 1, "b"), 2: Logprob(-1.0, 2, "c"), 3: Logprob(-2.0, 3, "d")},
        {1: Logprob(-0.2, 1, "b"), 2: Logprob(-1.5, 2, "c"), 3: Logprob(float("-inf"), 3, "d")},
    ]
    [first, second, third] = prompt_logprobs_of([4, 7, 1], rows, 2)  # type: ignore[arg-type]
    assert first is None
    assert sorted(second) == [1, 2, 7] and second[7].rank == 5 and second[7].decoded_token == "a"
    assert sorted(third) == [1, 2]
    assert prompt_logprobs_of([4, 1], [None, rows[2]], 3)[1][3].logprob == -9999.0  # type: ignore[index]
    assert prompt_logprobs_of([4], None, 2) is None


def test_continue_final_message_implies_no_generation_prompt() -> None:
    assert _add_generation_prompt(parse("chat")) is True
    assert _add_generation_prompt(parse("chat", add_generation_prompt=False)) is False
    assert _add_generation_prompt(parse("chat", continue_final_message=True)) is False
    assert _add_generation_prompt(parse("chat", continue_final_message=True, add_generation_prompt=False)) is False
    with pytest.raises(APIError, match="cannot both be true"):
        _add_generation_prompt(parse("chat", continue_final_message=True, add_generation_prompt=True))


def test_echo_takes_the_last_message_of_the_answers_role() -> None:
    messages = [*CHAT, {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert _echoed(parse("chat", messages=messages, echo=True), "assistant") == "a\nb"
    assert _echoed(parse("chat", messages=messages, echo=True), "user") is None
    assert _echoed(parse("chat", messages=messages), "assistant") is None


class RecordingTokenizer:
    """What render_chat asks of a tokenizer, recorded."""

    chat_template = "unused"

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        self.calls.append(kwargs)
        return "text"

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [1, 5] if add_special_tokens else [5]


def test_render_chat_passes_continue_final_message_and_special_tokens() -> None:
    tokenizer = RecordingTokenizer()
    assert render_chat(tokenizer, CHAT, add_generation_prompt=False, continue_final_message=True) == ("text", [5])
    assert tokenizer.calls[-1]["continue_final_message"] is True
    assert tokenizer.calls[-1]["add_generation_prompt"] is False
    assert render_chat(tokenizer, CHAT, add_special_tokens=True) == ("text", [1, 5])
    assert tokenizer.calls[-1]["continue_final_message"] is False


def test_continue_final_message_with_the_demo_template(demo_model_path: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path)
    conversation = [*CHAT, {"role": "assistant", "content": "An apple a day"}]
    text, token_ids = render_chat(tokenizer, conversation, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nAn apple a day")
    assert token_ids == tokenizer.encode(text, add_special_tokens=False)
    # An assistant message without content (null content renders as ""): continued from its header.
    text, _ = render_chat(
        tokenizer, [*CHAT, {"role": "assistant"}], add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_any_role_reaches_the_template(demo_model_path: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path)
    request = parse("chat", messages=[{"role": "narrator", "content": "Once"}])
    conversation = [m.as_template_input() for m in request.messages]
    assert "<|im_start|>narrator\nOnce<|im_end|>" in render_chat(tokenizer, conversation)[0]


def test_request_id_is_printable_and_bounded() -> None:
    assert parse("chat", request_id="a-b_c.1").request_id == "a-b_c.1"
    for bad in ("", "has space", "x" * 129, "tab\t"):
        with pytest.raises(pydantic.ValidationError, match="request_id"):
            parse("chat", request_id=bad)
