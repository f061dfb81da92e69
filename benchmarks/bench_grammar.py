"""The grammar libraries side by side: xgrammar and llguidance, on one tokenizer (CPU).

For each library it measures what structured output costs the engine:

- compile: the time to turn a spec (JSON schema, regex, grammar) into what a matcher runs, cold
  (a fresh compiler, so no cache) — paid once per distinct spec, off the engine loop;
- mask fill per token: walking a matcher along a valid document (a random instance of each of
  `--num-schemas` random schemas from `tests/structured_output/random_schemas.py`, tokenized),
  the time to fill one row of the token bitmask, and to fill a batch of rows at once with the
  library's parallel fill — paid every step for every structured request, on the host;
- coverage: which JSON-schema features, regexes and grammar syntaxes each accepts.

    .venv/bin/python benchmarks/bench_grammar.py [--tokenizer FOLDER] [--output FILE]

The default tokenizer is the demo model's (49,152 tokens).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.structured_output.random_schemas import random_instance, random_schema

# What each library is asked to compile, by feature: (kind, spec).
COVERAGE_CASES: dict[str, tuple[str, Any]] = {
    "json: nested objects, required, additionalProperties": (
        "json",
        {
            "type": "object",
            "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}},
            "required": ["a"],
            "additionalProperties": False,
        },
    ),
    "json: integer and number bounds": (
        "json",
        {
            "type": "object",
            "properties": {
                "i": {"type": "integer", "minimum": 3, "maximum": 17},
                "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            },
        },
    ),
    "json: enum, const": (
        "json",
        {"type": "object", "properties": {"e": {"enum": ["a", 1, None]}, "c": {"const": "k"}}},
    ),
    "json: string length, pattern": (
        "json",
        {
            "type": "object",
            "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5, "pattern": "^[a-z]+$"}},
        },
    ),
    "json: string formats (date-time, email, uuid)": (
        "json",
        {
            "type": "object",
            "properties": {
                "d": {"type": "string", "format": "date-time"},
                "m": {"type": "string", "format": "email"},
                "u": {"type": "string", "format": "uuid"},
            },
        },
    ),
    "json: arrays with minItems/maxItems": (
        "json",
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    ),
    "json: prefixItems (tuples)": (
        "json",
        {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
    ),
    "json: anyOf / oneOf": (
        "json",
        {"anyOf": [{"type": "string"}, {"type": "integer"}], "oneOf": [{"type": "string"}, {"type": "integer"}]},
    ),
    "json: allOf": (
        "json",
        {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    ),
    "json: $ref / $defs (recursive)": (
        "json",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                }
            },
            "$ref": "#/$defs/node",
        },
    ),
    "json: additionalProperties schema": ("json", {"type": "object", "additionalProperties": {"type": "integer"}}),
    "json: patternProperties": ("json", {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}}),
    "json: minProperties / maxProperties": (
        "json",
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 2},
    ),
    "json: uniqueItems": ("json", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    "json: multipleOf": ("json", {"type": "integer", "multipleOf": 5}),
    "json: any JSON object (json_object)": ("json", {"type": "object"}),
    "regex: alternation, classes, counts": ("regex", r"(yes|no|maybe) [A-Z][a-z]{2,5} \d{3}-\d{4}"),
    "regex: email-like": ("regex", r"[a-z0-9._]+@[a-z0-9]+\.(com|org|net)"),
    "EBNF / GBNF": ("ebnf", 'root ::= "(" expr ")"\nexpr ::= [0-9]+ ("+" [0-9]+)*'),
    "Lark": ("lark", 'start: "(" expr ")"\nexpr: /[0-9]+/ ("+" /[0-9]+/)*'),
    "choice": ("choice", ["positive", "negative", "neutral"]),
}


class Library:
    """What the benchmark asks of a grammar library."""

    name: str

    def compile(self, kind: str, spec: Any) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None: ...
    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None: ...
    def accept(self, matcher: Any, token_id: int) -> bool: ...


class XGrammar(Library):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import torch
        import xgrammar as xgr

        self.xgr, self.torch = xgr, torch
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.batch = None

    def compile(self, kind: str, spec: Any) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":"))
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "ebnf":
            return compiler.compile_grammar(spec)
        if kind == "choice":
            return compiler.compile_regex("|".join(_escape(c) for c in spec))
        raise ValueError(f"{kind} is not a syntax xgrammar reads")

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None:
        matcher.fill_next_token_bitmask(self.torch.from_numpy(bitmask), row)

    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        if self.batch is None:
            self.batch = self.xgr.BatchGrammarMatcher()
        self.batch.batch_fill_next_token_bitmask(matchers, self.torch.from_numpy(bitmask))

    def accept(self, matcher: Any, token_id: int) -> bool:
        return matcher.accept_token(token_id)


class LLGuidance(Library):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor()

    def compile(self, kind: str, spec: Any) -> Any:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        matcher_cls = self.llg.LLMatcher
        if kind == "json":
            grammar = matcher_cls.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = matcher_cls.grammar_from_regex(spec)
        elif kind == "lark":
            grammar = matcher_cls.grammar_from_lark(spec)
        elif kind == "ebnf":
            grammar = matcher_cls.grammar_from_lark(gbnf_to_lark(spec))
        elif kind == "choice":
            grammar = matcher_cls.grammar_from_regex("|".join(_escape(c) for c in spec))
        else:
            raise ValueError(kind)
        is_error, messages = matcher_cls.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(messages[0])
        # Warnings name schema keywords the grammar does not enforce: not covered.
        if messages:
            raise ValueError("; ".join(messages))
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tokenizer, compiled, log_level=0)

    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None:
        self.llg.numpy.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        self.llg.numpy.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher: Any, token_id: int) -> bool:
        return matcher.consume_token(token_id)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def _allowed(bitmask: np.ndarray, row: int, token_id: int) -> bool:
    return bool((int(bitmask[row, token_id // 32]) >> (token_id % 32)) & 1)


def measure_coverage(library: Library) -> dict[str, str]:
    result = {}
    for feature, (kind, spec) in COVERAGE_CASES.items():
        try:
            library.compile(kind, spec)
            result[feature] = "yes"
        except Exception as exc:  # every library has its own error types
            result[feature] = f"no ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
    return result


def measure_walk(
    library: Library, documents: list[tuple[dict, list[int]]], words: int
) -> tuple[list[float], list[float], float, int]:
    """Walk a matcher per document along its tokens; returns the compile times (s), the
    single-row fill times (µs), the batched fill time per row (µs) and the rejected tokens."""
    compile_s, fill_us, num_rejected = [], [], 0
    matchers = []
    for schema, _ in documents:
        start = time.perf_counter()
        compiled = library.compile("json", schema)
        compile_s.append(time.perf_counter() - start)
        matchers.append(library.matcher(compiled))
    bitmask = np.zeros((len(documents), words), dtype=np.int32)
    for i, (_, token_ids) in enumerate(documents):
        for token_id in token_ids:
            start = time.perf_counter()
            library.fill(matchers[i], bitmask, i)
            fill_us.append((time.perf_counter() - start) * 1e6)
            if not _allowed(bitmask, i, token_id) or not library.accept(matchers[i], token_id):
                num_rejected += 1
                break
    return compile_s, fill_us, _batched_fill_us(library, documents, words), num_rejected


def _batched_fill_us(library: Library, documents: list[tuple[dict, list[int]]], words: int) -> float:
    """All documents' matchers advanced together, one batched fill per step, as the engine
    does for a batch of structured requests: µs per row."""
    matchers = [library.matcher(library.compile("json", schema)) for schema, _ in documents]
    bitmask = np.zeros((len(documents), words), dtype=np.int32)
    total_s, total_rows = 0.0, 0
    for step in range(max(len(t) for _, t in documents)):
        live = [(m, t[step]) for m, (_, t) in zip(matchers, documents) if step < len(t)]
        start = time.perf_counter()
        library.fill_batch([m for m, _ in live], bitmask[: len(live)])
        total_s += time.perf_counter() - start
        total_rows += len(live)
        for matcher, token_id in live:
            library.accept(matcher, token_id)
    return total_s / total_rows * 1e6


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "p50": ordered[len(ordered) // 2],
        "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder; default: the demo model's")
    parser.add_argument("--num-schemas", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    if args.tokenizer is None:
        from shoal.demo_model import ensure_demo_model

        args.tokenizer = ensure_demo_model()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab_size = len(tokenizer)
    words = -(-vocab_size // 32)
    rng = random.Random(args.seed)
    schemas = [random_schema(rng) for _ in range(args.num_schemas)]
    documents = [
        (s, tokenizer.encode(json.dumps(random_instance(s, rng), separators=(",", ":")), add_special_tokens=False))
        for s in schemas
    ]
    factories: list[Callable[[], Library]] = [
        lambda: XGrammar(tokenizer, vocab_size),
        lambda: LLGuidance(tokenizer, vocab_size),
    ]
    report: dict[str, Any] = {"tokenizer": args.tokenizer, "vocab_size": vocab_size, "machine": platform.processor()}
    for factory in factories:
        start = time.perf_counter()
        library = factory()
        setup_s = time.perf_counter() - start
        compile_s, fill_us, batched_us, rejected = measure_walk(library, documents, words)
        report[library.name] = {
            "tokenizer_setup_s": setup_s,
            "compile_ms": _summary([s * 1e3 for s in compile_s]),
            "fill_us_per_token": _summary(fill_us),
            "batched_fill_us_per_row": batched_us,
            "num_tokens": len(fill_us),
            "rejected_valid_documents": rejected,
            "coverage": measure_coverage(library),
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
