"""Grammars: what the frontend refuses, what the matcher allows step by step on a tokenizer,
and the parameters' own rules."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from shoal.sampling_params import SamplingParams
from shoal.structured_output.grammar import GrammarCompiler, Matcher, json_schema_text, validate
from shoal.structured_output.params import StructuredOutputsParams
from tests.structured_output.random_schemas import random_instance, random_schema


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints: dict[str, Path]):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer))


def allowed(matcher: Matcher, vocab_size: int) -> set[int]:
    bitmask = np.zeros((1, -(-vocab_size // 32)), dtype=np.int32)
    matcher.fill(bitmask, 0)
    return {t for t in range(vocab_size) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputsParams(json={"type": "foo"}), 'invalid JSON schema: Unsupported type "foo"'),
        (StructuredOutputsParams(json={"$ref": "#/$defs/missing"}), "invalid JSON schema"),
        (StructuredOutputsParams(json='{"type": "object"'), "invalid JSON schema: not JSON"),
        (StructuredOutputsParams(regex="(ab"), "invalid regex"),
        (StructuredOutputsParams(grammar='start ::= "a"'), "invalid grammar"),
    ],
)
def test_bad_specs_are_value_errors_without_library_noise(params: StructuredOutputsParams, message: str) -> None:
    with pytest.raises(ValueError, match="^" + message) as info:
        validate(params)
    assert ".cc:" not in str(info.value)


def test_good_specs_validate() -> None:
    for params in (
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutputsParams(regex=r"\d{3}"),
        StructuredOutputsParams(choice=["yes", "no (really)"]),
        StructuredOutputsParams(grammar='root ::= "a" | "b"'),
        StructuredOutputsParams(json_object=True),
    ):
        validate(params)


def test_params_need_exactly_one_spec() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json={"type": "object"}).json == '{"type":"object"}'


def test_sampling_params_rules() -> None:
    spec = StructuredOutputsParams(regex="a")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_outputs=spec, ignore_eos=True)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(structured_outputs=spec, min_tokens=1)
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="logit_bias token ids"):
        SamplingParams(logit_bias={-1: 1.0})
    assert SamplingParams(logit_bias={"3": 1}).logit_bias == {3: 1.0}


def test_valid_documents_walk_through_the_matcher(compiler: GrammarCompiler, tokenizer) -> None:
    """Every token of a valid document is in the mask where it comes, and the document ends
    the grammar: after it only eos is allowed."""
    rng = random.Random(1)
    vocab_size = len(tokenizer)
    for _ in range(10):
        schema = random_schema(rng)
        text = json.dumps(random_instance(schema, rng), separators=(", ", ": "))
        matcher = Matcher(compiler.compile(StructuredOutputsParams(json=schema)), [tokenizer.eos_token_id])
        for token_id in tokenizer.encode(text, add_special_tokens=False):
            assert token_id in allowed(matcher, vocab_size), (schema, text)
            assert matcher.accept(token_id)
        assert allowed(matcher, vocab_size) == {tokenizer.eos_token_id}
        assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated


def test_choice_allows_only_its_strings(compiler: GrammarCompiler, tokenizer) -> None:
    matcher = Matcher(compiler.compile(StructuredOutputsParams(choice=["one two", "three"])), [tokenizer.eos_token_id])
    first = allowed(matcher, len(tokenizer))
    assert first and all("one two".startswith(s) or "three".startswith(s) for s in map(tokenizer.decode, first))
    assert not matcher.accept(tokenizer.encode("four", add_special_tokens=False)[0])


def test_bounded_strings_exclude_control_characters(compiler: GrammarCompiler, tokenizer) -> None:
    """JSON forbids unescaped control characters; xgrammar's own rule for a string with a
    length bound lets them through, so shoal gives such strings a pattern."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]}
    assert json.loads(json_schema_text(json.dumps(schema)))["properties"]["s"]["pattern"]
    matcher = Matcher(compiler.compile(StructuredOutputsParams(json=schema)), [tokenizer.eos_token_id])
    for token_id in tokenizer.encode('{"s": "', add_special_tokens=False):
        assert matcher.accept(token_id)
    decoded = {t: tokenizer.decode([t]) for t in allowed(matcher, len(tokenizer))}
    assert decoded and not any(any(ord(c) < 0x20 for c in text) for text in decoded.values())
