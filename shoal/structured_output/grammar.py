"""The grammar library behind structured output: xgrammar (see docs/openai-extensions.md for
why it was chosen over llguidance: a mask fill per token several times cheaper, measured by
`benchmarks/bench_grammar.py`).

- `validate(params)`: parse the spec into a grammar without a tokenizer (a millisecond or so);
  the frontend calls it so that a bad schema is a `ValueError` (an HTTP 400) before anything
  reaches the engine core.
- `GrammarCompiler`: the engine core's compiler for one tokenizer (the grammar's token-mask
  cache is built here; xgrammar caches what it compiled).
- `Matcher`: one request's position in its grammar: accept tokens, fill its row of the bitmask.

Bitmasks are numpy int32 arrays `[num_rows, ceil(vocab_size / 32)]`, bit `t % 32` of word
`t // 32` set where token t is allowed.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from typing import Any

import numpy as np

from shoal.structured_output.lark import is_lark, lark_to_ebnf
from shoal.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# The separators of JSON written without free whitespace (xgrammar's own when indent is None).
_JSON_SEPARATORS = (", ", ": ")
# What `json_object` means: any JSON object.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'


def _xgrammar() -> Any:
    import xgrammar

    return xgrammar


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def choice_regex(choices: list[str]) -> str:
    return "|".join(re.escape(choice) for choice in choices)


def grammar_ebnf(spec: str) -> str:
    """A `grammar` spec as xgrammar reads it: EBNF as given, Lark converted (`lark.py`)."""
    return lark_to_ebnf(spec) if is_lark(spec) else spec


def validate(params: StructuredOutputsParams) -> None:
    """Raise `ValueError` naming the problem when `params`' spec is not a grammar xgrammar can
    build (a schema with an unknown type or a dangling $ref, a bad regex, EBNF without a root)."""
    _validate_key(params.key)


@functools.lru_cache(maxsize=1024)
def _validate_key(key: tuple[str, str, bool]) -> None:
    kind, spec, strict_whitespace = key
    xgr = _xgrammar()
    try:
        if kind in ("json", "json_object"):
            schema = json_schema_text(spec) if kind == "json" else _ANY_OBJECT_SCHEMA
            xgr.Grammar.from_json_schema(schema, **_json_options(strict_whitespace))
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            xgr.Grammar.from_regex(choice_regex(json.loads(spec)))
        else:
            xgr.Grammar.from_ebnf(grammar_ebnf(spec))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"invalid {_KIND_NAMES[kind]}: {_library_message(exc)}") from exc


_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def _json_options(strict_whitespace: bool) -> dict[str, Any]:
    if strict_whitespace:
        return {"any_whitespace": False, "separators": _JSON_SEPARATORS}
    return {"any_whitespace": True}


# A JSON string's characters other than the quote, the backslash and control characters.
_PLAIN_STRING_CHARACTERS = r'[^"\\\x00-\x1f\ud800-\udfff]'


def json_schema_text(spec: str) -> str:
    """The schema as xgrammar is given it. A string with a length bound but no pattern or format
    gets the pattern of that many plain characters: xgrammar's own rule for bounded strings
    lets control characters (U+0000-U+001F) and UTF-16 surrogates through, which JSON forbids
    unescaped, so a document could come out that no JSON parser reads (escapes are not allowed
    there either way)."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from exc
    return json.dumps(_bound_plain_strings(schema))


def _bound_plain_strings(node: Any) -> Any:
    if isinstance(node, list):
        return [_bound_plain_strings(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _bound_plain_strings(value) for key, value in node.items()}
    bounded = "minLength" in node or "maxLength" in node
    if node.get("type") == "string" and bounded and "pattern" not in node and "format" not in node:
        # The pattern carries the bounds (xgrammar ignores them beside a pattern, with a warning).
        low, high = int(node.pop("minLength", 0)), node.pop("maxLength", None)
        node["pattern"] = f"^{_PLAIN_STRING_CHARACTERS}{{{low},{'' if high is None else int(high)}}}$"
    return node


def _library_message(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location ("[hh:mm:ss] file.cc:123: ...")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)


class GrammarCompiler:
    """Compiles specs for one tokenizer. Thread-safe; the engine core calls it from its compile
    thread, never from the engine loop."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # One thread: the engine has one compile thread, and the host's cores run the steps.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of `params` (`ValueError` if it cannot be built)."""
        kind, spec, strict_whitespace = params.key
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(json_schema_text(spec), **_json_options(strict_whitespace))
            if kind == "json_object":
                return self._compiler.compile_json_schema(_ANY_OBJECT_SCHEMA, **_json_options(strict_whitespace))
            if kind in ("regex", "choice"):
                return self._compiler.compile_regex(spec if kind == "regex" else choice_regex(params.choice or []))
            return self._compiler.compile_grammar(grammar_ebnf(spec))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"invalid {_KIND_NAMES[kind]}: {_library_message(exc)}") from exc


class Matcher:
    """One request's state in its grammar. `stop_token_ids` are the tokens that end the request
    (its eos and stop tokens): once the grammar is complete, only they are allowed."""

    def __init__(self, compiled: Any, stop_token_ids: list[int]) -> None:
        self._matcher = _xgrammar().GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        # Tokens the next position allows beside the grammar's (a reasoning model's think-start
        # at its first token); whoever sets them clears them once the token is sampled.
        self.also_allowed: tuple[int, ...] = ()

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self.allow_also(bitmask, row)

    def allow_also(self, bitmask: np.ndarray, row: int) -> None:
        words = bitmask.view(np.uint32)  # bit 31 does not fit an int32 literal
        for token_id in self.also_allowed:
            words[row, token_id // 32] |= np.uint32(1 << (token_id % 32))

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)


def fill_rows(matchers: list[Matcher], bitmask: np.ndarray) -> None:
    """Row i of `bitmask` for `matchers[i]`; many rows are filled by xgrammar's threads at once."""
    if len(matchers) < _BATCH_FILL_MIN_ROWS:
        for row, matcher in enumerate(matchers):
            matcher.fill(bitmask, row)
        return
    _batch_matcher().batch_fill_next_token_bitmask([m._matcher for m in matchers], bitmask)
    for row, matcher in enumerate(matchers):
        matcher.allow_also(bitmask, row)


# Below this many rows a loop costs less than handing the rows to xgrammar's thread pool.
_BATCH_FILL_MIN_ROWS = 8


@functools.cache
def _batch_matcher() -> Any:
    return _xgrammar().BatchGrammarMatcher(max_threads="auto")
