"""Reasoning parsers on text: the thinking split from the answer, whole or streamed."""

from __future__ import annotations

import pytest

from shoal.entrypoints.openai.chat_output import ChoiceOutput
from shoal.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from shoal.entrypoints.openai.tool_parsers import get_tool_parser

CASES = [
    ("deepseek_r1", "Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek_r1", "<think>Hmm.</think>\n\nFour.", "Hmm.", "\n\nFour."),
    ("deepseek_r1", "Still thinking when the tokens ran out", "Still thinking when the tokens ran out", None),
    ("qwen3", "<think>\nok\n</think>\n\nFour.", "\nok\n", "\n\nFour."),
    ("qwen3", "Four, without thinking.", None, "Four, without thinking."),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_split(name: str, text: str, reasoning: str | None, content: str | None) -> None:
    assert get_reasoning_parser(name).split(text, final=True) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
@pytest.mark.parametrize("step", [1, 4])
def test_stream_adds_up(name: str, text: str, reasoning: str | None, content: str | None, step: int) -> None:
    output = ChoiceOutput(get_reasoning_parser(name), None)
    streamed_reasoning, streamed_content = "", ""
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        delta = output.delta(piece, final=i == len(pieces) - 1)
        if delta is not None:
            streamed_reasoning += delta.reasoning_content or ""
            streamed_content += delta.content or ""
    assert streamed_reasoning == (reasoning or "") and streamed_content == (content or "")


def test_reasoning_then_tool_calls() -> None:
    text = 'I should call it.</think><tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    reasoning, content, calls = ChoiceOutput(get_reasoning_parser("deepseek_r1"), get_tool_parser("hermes")).message(
        text
    )
    assert reasoning == "I should call it." and content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == [("f", '{"x": 1}')]


def test_prompt_that_ends_thinking() -> None:
    parser = get_reasoning_parser("qwen3")
    assert parser.prompt_ends_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not parser.prompt_ends_thinking("<|im_start|>assistant\n")
