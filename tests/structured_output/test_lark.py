"""Lark grammars for structured output: the conversion to EBNF accepts what Lark parses and
refuses what Lark refuses, unsupported constructs are named, and a tiny random model constrained
by a Lark grammar writes text that Lark parses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from shoal import LLM, SamplingParams
from shoal.sampling_params import StructuredOutputsParams
from shoal.structured_output.grammar import validate
from shoal.structured_output.lark import is_lark, lark_to_ebnf

# lark is a test dependency (make install-test); the GPU machine lacks it, and its GPU run only
# collects this file.
lark = pytest.importorskip("lark")

# vLLM's tests' SQL grammar (no %ignore: the statement has no spaces).
SQL = """
start: select_statement
select_statement: "SELECT" column "from" table "where" condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column "=" number
number: "1" | "2"
"""

# The grammar vLLM's structured-output docs showed: prefixes, a regexp, a repeated group.
SQL_DOCS = r"""
    ?start: select_statement

    ?select_statement: "SELECT " column_list " FROM " table_name

    ?column_list: column_name ("," column_name)*

    ?table_name: identifier

    ?column_name: identifier

    ?identifier: /[a-zA-Z_][a-zA-Z0-9_]*/
"""

# Lark's calculator: left recursion, aliases, common terminals, an ignored terminal.
CALC = r"""
?start: sum
?sum: product
    | sum "+" product   -> add
    | sum "-" product   -> sub
?product: atom
    | product "*" atom  -> mul
?atom: NUMBER           -> number
     | "-" atom         -> neg
     | NAME             -> var
     | "(" sum ")"
     | ESCAPED_STRING
%import common.CNAME -> NAME
%import common.NUMBER
%import common.ESCAPED_STRING
%import common.WS
%ignore WS
"""

# Ranges, case-insensitive strings, [optional], repetition bounds and a terminal with a priority.
MISC = """
start: greeting ("," WORD)~1..3 [END]
greeting: "hello"i | "hi"
WORD.2: ("a".."z")+
END: "!"
"""

CASES = {
    SQL: ["SELECTcol_1fromtable_2wherecol_2=1", "SELECTcol_1fromtable_1wherecol_1=3", "SELECT col_1"],
    SQL_DOCS: ["SELECT a,b_2 FROM t", "SELECT a FROM t1", "SELECT  a FROM t", "SELECT 1a FROM t"],
    CALC: ["1+2", " 1 + x*(3.5e2 - -y_1) ", '"a\\"b" * 2', "1 2", "1+", "(1"],
    MISC: ["HeLLo,ab,c!", "hi,x", "hi", "hello,a,b,c,d", "Hi,a"],
}


def _lark_parses(grammar: str, text: str) -> bool:
    try:
        lark.Lark(grammar).parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


@pytest.mark.parametrize("grammar", list(CASES), ids=["sql", "sql_docs", "calc", "misc"])
def test_the_converted_grammar_accepts_what_lark_parses(grammar: str) -> None:
    assert is_lark(grammar)
    ebnf = xgr.Grammar.from_ebnf(lark_to_ebnf(grammar))
    for text in CASES[grammar]:
        assert _is_grammar_accept_string(ebnf, text) == _lark_parses(grammar, text), text
    assert any(_lark_parses(grammar, t) for t in CASES[grammar])
    assert not all(_lark_parses(grammar, t) for t in CASES[grammar])


def test_ebnf_is_left_as_it_is() -> None:
    ebnf = 'root ::= "a" item\nitem ::= [0-9]+'
    assert not is_lark(ebnf)
    validate(StructuredOutputsParams(grammar=ebnf))


@pytest.mark.parametrize(
    ("grammar", "named"),
    [
        ("start: x\n%declare x", "%declare"),
        ('start: _sep{"a", ","}', "templates"),
        ("start: /abc/i", "flags"),
        ("start: /a(?=b)/", "Lookahead"),
        ("start: NAME\n%import .mylib.NAME", "common"),
        ("start: FOO\n%import common.FOO", "no terminal FOO"),
        ("start: NUMBER", "add %import common.NUMBER"),
        ('start: "a"\n%override start: "b"', "%override"),
    ],
)
def test_unsupported_lark_is_a_value_error_naming_it(grammar: str, named: str) -> None:
    with pytest.raises(ValueError, match="^invalid grammar: .*" + named.replace(".", r"\.")):
        validate(StructuredOutputsParams(grammar=grammar))


@pytest.fixture(scope="module")
def llm(tiny_checkpoints: dict[str, Path]) -> Iterator[LLM]:
    engine = LLM(str(tiny_checkpoints["llama"]), multiprocess=False, max_model_len=256, async_scheduling=False)
    yield engine
    engine.shutdown()


# Common terminals and an ignored one, in a bounded language (a random model finishes it).
PAIRS = """
start: pair ("," pair)~0..2
pair: KEY "=" VALUE
KEY: LCASE_LETTER~1..3
VALUE: DIGIT~1..2 | "true" | "false"
%import common.LCASE_LETTER
%import common.DIGIT
%import common.WS_INLINE
%ignore WS_INLINE
"""


@pytest.mark.parametrize("grammar", [SQL, PAIRS, MISC], ids=["sql", "pairs", "misc"])
def test_a_random_model_writes_what_lark_parses(llm: LLM, grammar: str) -> None:
    params = SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=120, structured_outputs=StructuredOutputsParams(grammar=grammar)
    )
    [output] = llm.generate(["Answer:"], params, use_tqdm=False)
    for completion in output.outputs:
        assert completion.finish_reason == "stop", completion
        lark.Lark(grammar).parse(completion.text)
