"""Where a reasoning model's constraint starts (`StructuredRequest` with the real grammar
library): a model that opens its thinking itself may write the think-start token or the
grammar's first token, and nothing else, at its first token; a prompt that opened the thinking
leaves the output free until the think-end token; without reasoning tokens the grammar applies
from the first token."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shoal.structured_output.grammar import GrammarCompiler, bitmask_words, fill_rows
from shoal.structured_output.manager import StructuredRequest
from shoal.structured_output.params import StructuredOutputsParams


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints: dict[str, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer))


@pytest.fixture(scope="module")
def markers(tokenizer: Any) -> tuple[int, int]:
    """Two tokens no grammar here allows, standing for <think> and </think>."""
    start, end = tokenizer.convert_tokens_to_ids(["<|filler_0|>", "<|filler_1|>"])
    return start, end


def structured(compiler: GrammarCompiler, tokenizer: Any, **reasoning: Any) -> StructuredRequest:
    params = StructuredOutputsParams(choice=["yes", "no"], **reasoning)
    compiled: Future = Future()
    compiled.set_result(compiler.compile(params))
    request = StructuredRequest(params, compiled, [tokenizer.eos_token_id])
    assert request.start()
    return request


def allowed_rows(requests: list[StructuredRequest], vocab_size: int) -> list[set[int] | None]:
    """Each request's allowed next tokens (None: its next token is free)."""
    constrained = [r for r in requests if r.constrains_next_token]
    bitmask = np.zeros((len(constrained), bitmask_words(vocab_size)), dtype=np.int32)
    fill_rows([r.matcher for r in constrained], bitmask)  # type: ignore[misc]
    rows = iter(range(len(constrained)))
    out: list[set[int] | None] = []
    for request in requests:
        if not request.constrains_next_token:
            out.append(None)
            continue
        row = next(rows)
        out.append({t for t in range(vocab_size) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1})
    return out


def allowed(request: StructuredRequest, vocab_size: int) -> set[int] | None:
    return allowed_rows([request], vocab_size)[0]


def test_a_model_that_opens_its_thinking(compiler: GrammarCompiler, tokenizer: Any, markers: tuple) -> None:
    start, end = markers
    vocab_size = len(tokenizer)
    free = structured(compiler, tokenizer)
    grammar_first = allowed(free, vocab_size)
    assert grammar_first and start not in grammar_first
    thinker = structured(compiler, tokenizer, reasoning_start_token_id=start, reasoning_end_token_ids=[end])
    assert allowed(thinker, vocab_size) == grammar_first | {start}
    hmm = tokenizer.encode("hmm yes", add_special_tokens=False)
    assert thinker.accept([start, *hmm])  # thinking: anything goes
    assert allowed(thinker, vocab_size) is None
    assert thinker.accept([start, end])  # a second <think> is thinking too; then it ends
    assert allowed(thinker, vocab_size) == grammar_first  # the answer, from its first token
    assert thinker.accept(tokenizer.encode("no", add_special_tokens=False))
    assert allowed(thinker, vocab_size) == {tokenizer.eos_token_id}


def test_a_first_token_of_the_answer_ends_the_chance_to_think(
    compiler: GrammarCompiler, tokenizer: Any, markers: tuple
) -> None:
    start, end = markers
    vocab_size = len(tokenizer)
    request = structured(compiler, tokenizer, reasoning_start_token_id=start, reasoning_end_token_ids=[end])
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert request.accept(yes[:1])
    after = allowed(request, vocab_size)
    assert after is not None and start not in after and end not in after
    assert request.accept(yes[1:]) and allowed(request, vocab_size) == {tokenizer.eos_token_id}


def test_a_prompt_that_opened_the_thinking(compiler: GrammarCompiler, tokenizer: Any, markers: tuple) -> None:
    _, end = markers
    request = structured(compiler, tokenizer, reasoning_end_token_ids=[end])
    assert allowed(request, len(tokenizer)) is None
    assert request.accept([*tokenizer.encode("yes no", add_special_tokens=False), end])
    assert allowed(request, len(tokenizer)) == allowed(structured(compiler, tokenizer), len(tokenizer))


def test_many_rows_allow_the_think_start_too(compiler: GrammarCompiler, tokenizer: Any, markers: tuple) -> None:
    """Past a few rows the bitmask is filled by xgrammar's batch call: the extra token is set
    there too (and only in the rows that may think)."""
    start, end = markers
    thinkers = [
        structured(compiler, tokenizer, reasoning_start_token_id=start, reasoning_end_token_ids=[end]) for _ in range(6)
    ]
    plain = [structured(compiler, tokenizer) for _ in range(4)]
    rows = allowed_rows([*thinkers, *plain], len(tokenizer))
    grammar_first = rows[-1]
    assert grammar_first and rows[:6] == [grammar_first | {start}] * 6 and rows[6:] == [grammar_first] * 4
