"""Lark grammars for structured output: vLLM's clients send `guided_grammar` (and
`structured_outputs.grammar`) in Lark's syntax, while xgrammar reads EBNF (`name ::= ...`).

`is_lark(text)` tells the two apart (an EBNF grammar defines its rules with `::=`, a Lark one with
`:`); `lark_to_ebnf(text)` converts the Lark subset that grammars for constrained decoding use:

- rules `name: ...` and terminals `NAME: ...` (the `?` and `!` prefixes, priorities `.n` and
  aliases `-> name` are read and dropped: they shape Lark's parse tree, not the language);
- alternatives `|`, grouping `( )`, optional `[ ]`, the operators `?`, `*`, `+`, `~ n` and `~ n..m`;
- string literals (`"..."`, `"..."i`), character ranges `"a".."z"`, and regular expressions
  `/.../` (those xgrammar's regex converter takes: no lookaround, no flags);
- `%import common.NAME` (also `-> ALIAS` and `%import common (A, B)`) for Lark's common terminals
  (`COMMON_TERMINALS`), and `%ignore` (what it names may appear before every token and at the end).

The start rule is `start`, else the first rule. Anything else (templates, `%declare`,
`%override`, `%extend`, other modules) raises `ValueError` naming the construct. The conversion
works on characters, not on Lark's lexer: it gives the language of the grammar without the
lexer's longest-match rule, which is what a decoder needs (every output the grammar's parser
reads is allowed).
"""

from __future__ import annotations

import ast
import functools
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

# An EBNF grammar names its rules with `::=`; Lark with `:`.
_EBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w.-]*\s*::=", re.MULTILINE)
_LARK_LINE = re.compile(r"^\s*(%import|%ignore|[?!]?[A-Za-z_]\w*(\.\d+)?\s*:(?!:))", re.MULTILINE)

_TOKEN = re.compile(
    r"""
    (?P<space>[ \t\f\r]+)
  | (?P<comment>//[^\n]*)
  | (?P<newline>\n)
  | (?P<directive>%[a-z]+)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regexp>/(?:[^/\\\n]|\\.)+/[a-z]*)
  | (?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)
  | (?P<number>\d+)
  | (?P<op>\.\.|->|[:|()\[\]?*+~{},.!])
    """,
    re.VERBOSE,
)

# Lark's common terminals (its `common.lark`), written in the subset this module reads.
COMMON_TERMINALS = r"""
DIGIT: "0".."9"
HEXDIGIT: "a".."f" | "A".."F" | DIGIT
INT: DIGIT+
SIGNED_INT: ["+" | "-"] INT
DECIMAL: INT "." INT? | "." INT
_EXP: ("e" | "E") SIGNED_INT
FLOAT: INT _EXP | DECIMAL _EXP?
SIGNED_FLOAT: ["+" | "-"] FLOAT
NUMBER: FLOAT | INT
SIGNED_NUMBER: ["+" | "-"] NUMBER
ESCAPED_STRING: "\"" /([^"\\\n]|\\.)*/ "\""
LCASE_LETTER: "a".."z"
UCASE_LETTER: "A".."Z"
LETTER: UCASE_LETTER | LCASE_LETTER
WORD: LETTER+
CNAME: ("_" | LETTER) ("_" | LETTER | DIGIT)*
WS_INLINE: (" " | "\t")+
WS: (" " | "\t" | "\f" | "\r" | "\n")+
CR: "\r"
LF: "\n"
NEWLINE: (CR? LF)+
SH_COMMENT: /#[^\n]*/
CPP_COMMENT: /\/\/[^\n]*/
C_COMMENT: /\/\*([^*]|\*+[^*\/])*\*+\//
SQL_COMMENT: /--[^\n]*/
"""

# The EBNF names this module adds (a Lark name equal to one of them is renamed).
_ROOT, _IGNORED = "root", "lark_ignored"


def is_lark(text: str) -> bool:
    """Whether a grammar is written in Lark's syntax rather than EBNF."""
    return _EBNF_RULE.search(text) is None and _LARK_LINE.search(text) is not None


def lark_to_ebnf(text: str) -> str:
    """The EBNF (xgrammar's dialect) of a Lark grammar; `ValueError` for what it cannot convert."""
    return _convert(text)


@functools.lru_cache(maxsize=256)
def _convert(text: str) -> str:
    grammar = _parse(text)
    _resolve_imports(grammar)
    return _Emitter(grammar).emit()


# ---- reading Lark ----------------------------------------------------------------------------

# A parsed expansion: ("alt", [nodes]), ("seq", [nodes]), ("repeat", node, low, high | None),
# ("literal", text, case_insensitive), ("range", first, last), ("regexp", pattern), ("ref", name).
Node = tuple[Any, ...]


@dataclass
class _Grammar:
    definitions: dict[str, Node] = field(default_factory=dict)  # in order of definition
    imports: dict[str, str] = field(default_factory=dict)  # local name -> common terminal
    ignored: list[Node] = field(default_factory=list)


def _parse(text: str) -> _Grammar:
    grammar = _Grammar()
    for statement in _statements(_tokens(text)):
        _Statement(statement, grammar).read()
    if not any(not _is_terminal(name) for name in grammar.definitions):
        raise ValueError("the Lark grammar defines no rule (a lowercase name followed by ':')")
    return grammar


def _tokens(text: str) -> list[tuple[str, str]]:
    tokens, position = [], 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise ValueError(f"cannot read the Lark grammar at {text[position : position + 20]!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind not in ("space", "comment"):
            tokens.append((kind, match.group()))
        position = match.end()
    return tokens


def _statements(tokens: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Tokens split at line ends, except before a `|` that continues the line and inside
    brackets."""
    statements: list[list[tuple[str, str]]] = [[]]
    depth = 0
    for i, (kind, value) in enumerate(tokens):
        if kind == "newline":
            following = next((t for t in tokens[i + 1 :] if t[0] != "newline"), None)
            if depth == 0 and not (following and following == ("op", "|")):
                statements.append([])
            continue
        if value in ("(", "["):
            depth += 1
        elif value in (")", "]"):
            depth -= 1
        statements[-1].append((kind, value))
    return [s for s in statements if s]


class _Statement:
    """One definition or directive, read by recursive descent."""

    def __init__(self, tokens: list[tuple[str, str]], grammar: _Grammar) -> None:
        self.tokens = tokens
        self.position = 0
        self.grammar = grammar

    def peek(self, offset: int = 0) -> tuple[str, str] | None:
        index = self.position + offset
        return self.tokens[index] if index < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token is None:
            raise ValueError(f"the Lark statement {self.text()!r} ends too early")
        self.position += 1
        return token

    def expect(self, kind: str, value: str | None = None) -> str:
        token = self.take()
        if token[0] != kind or (value is not None and token[1] != value):
            raise ValueError(f"in the Lark statement {self.text()!r}: expected {value or kind}, got {token[1]!r}")
        return token[1]

    def at(self, value: str) -> bool:
        token = self.peek()
        return token is not None and token[0] == "op" and token[1] == value

    def text(self) -> str:
        return " ".join(value for _, value in self.tokens)

    def read(self) -> None:
        first = self.peek()
        assert first is not None
        if first[0] == "directive":
            self.directive()
        else:
            self.definition()
        extra = self.peek()
        if extra is not None:
            raise ValueError(f"in the Lark statement {self.text()!r}: unexpected {extra[1]!r}")

    def definition(self) -> None:
        if self.at("?") or self.at("!"):
            self.take()  # inlining / keeping tokens: the tree's shape, not the language
        name = self.expect("name")
        if "." in name:
            raise ValueError(f"the Lark name {name!r} is not a valid rule or terminal name")
        if self.at("."):
            self.take()
            self.expect("number")  # a priority: the lexer's, meaningless without it
        if self.at("{"):
            raise ValueError(f"Lark templates ({name}{{...}}) are not supported")
        self.expect("op", ":")
        if name in self.grammar.definitions:
            raise ValueError(f"the Lark grammar defines {name!r} twice")
        self.grammar.definitions[name] = self.expansions()

    def directive(self) -> None:
        directive = self.take()[1]
        if directive == "%import":
            self.import_()
        elif directive == "%ignore":
            self.grammar.ignored.append(self.expansions())
        else:
            raise ValueError(f"the Lark directive {directive} is not supported")

    def import_(self) -> None:
        path = self.take()[1]
        module, _, name = path.partition(".")
        if module != "common":
            raise ValueError(f"{self.text()}: only Lark's common terminals (%import common.NAME) are supported")
        if name:
            alias = name
            if self.at("->"):
                self.take()
                alias = self.expect("name")
            self.grammar.imports[alias] = name
            return
        self.expect("op", "(")
        while True:
            name = self.expect("name")
            self.grammar.imports[name] = name
            if self.at(")"):
                self.take()
                return
            self.expect("op", ",")

    def expansions(self) -> Node:
        alternatives = [self.alias()]
        while self.at("|"):
            self.take()
            alternatives.append(self.alias())
        return alternatives[0] if len(alternatives) == 1 else ("alt", alternatives)

    def alias(self) -> Node:
        items = []
        while (token := self.peek()) is not None and token[1] not in ("|", ")", "]", "->"):
            items.append(self.item())
        if self.at("->"):
            self.take()
            self.expect("name")  # a name for the tree node
        return items[0] if len(items) == 1 else ("seq", items)

    def item(self) -> Node:
        atom = self.atom()
        if self.at("?"):
            self.take()
            return ("repeat", atom, 0, 1)
        if self.at("*"):
            self.take()
            return ("repeat", atom, 0, None)
        if self.at("+"):
            self.take()
            return ("repeat", atom, 1, None)
        if self.at("~"):
            self.take()
            low = int(self.expect("number"))
            high = low
            if self.at(".."):
                self.take()
                high = int(self.expect("number"))
            return ("repeat", atom, low, high)
        return atom

    def atom(self) -> Node:
        kind, value = self.take()
        if value == "(" and kind == "op":
            inner = self.expansions()
            self.expect("op", ")")
            return inner
        if value == "[" and kind == "op":
            inner = self.expansions()
            self.expect("op", "]")
            return ("repeat", inner, 0, 1)
        if kind == "string":
            return self.literal(value)
        if kind == "regexp":
            return _regexp(value)
        if kind == "name" and "." not in value:
            if self.at("{"):
                raise ValueError(f"Lark templates ({value}{{...}}) are not supported")
            return ("ref", value)
        raise ValueError(f"in the Lark statement {self.text()!r}: unexpected {value!r}")

    def literal(self, token: str) -> Node:
        case_insensitive = token.endswith("i")
        text = _string_value(token.removesuffix("i"))
        if self.at(".."):
            self.take()
            last = _string_value(self.expect("string"))
            if len(text) != 1 or len(last) != 1:
                raise ValueError(f"a Lark range needs single characters, got {text!r}..{last!r}")
            return ("range", text, last)
        return ("literal", text, case_insensitive)


def _string_value(token: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "\d" and friends stay as they are, as in Lark
        try:
            value = ast.literal_eval(token)
        except (SyntaxError, ValueError) as exc:
            raise ValueError(f"cannot read the Lark string {token}") from exc
    assert isinstance(value, str)
    return value


def _regexp(token: str) -> Node:
    body, _, flags = token[1:].rpartition("/")
    if flags:
        raise ValueError(f"Lark regexp flags ({token}) are not supported")
    return ("regexp", body.replace("\\/", "/"))


def _is_terminal(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


@functools.cache
def _common() -> _Grammar:
    return _parse_terminals(COMMON_TERMINALS)


def _parse_terminals(text: str) -> _Grammar:
    grammar = _Grammar()
    for statement in _statements(_tokens(text)):
        _Statement(statement, grammar).read()
    return grammar


def _resolve_imports(grammar: _Grammar) -> None:
    """Copy each imported common terminal, and the ones it uses, into the grammar."""
    common = _common().definitions
    for alias, name in grammar.imports.items():
        if name not in common:
            raise ValueError(
                f"%import common.{name}: Lark's common module has no terminal {name} (supported: "
                f"{', '.join(n for n in common if not n.startswith('_'))})"
            )
        if alias in grammar.definitions:
            raise ValueError(f"the Lark grammar defines {alias!r} and imports it too")
        grammar.definitions[alias] = common[name]
        for dependency in _dependencies(common[name], common):
            grammar.definitions.setdefault(dependency, common[dependency])


def _dependencies(node: Node, definitions: dict[str, Node]) -> list[str]:
    found: list[str] = []

    def visit(n: Node) -> None:
        kind = n[0]
        if kind == "ref" and n[1] not in found:
            found.append(n[1])
            visit(definitions[n[1]])
        elif kind in ("alt", "seq"):
            for child in n[1]:
                visit(child)
        elif kind == "repeat":
            visit(n[1])

    visit(node)
    return found


# ---- writing EBNF ----------------------------------------------------------------------------


class _Emitter:
    """EBNF text for a parsed grammar. With `%ignore`, every token a rule uses (a literal, a
    range, a regexp or a terminal) may be preceded by what is ignored, and so may the end."""

    def __init__(self, grammar: _Grammar) -> None:
        self.grammar = grammar
        self.names = {name: self._ebnf_name(name) for name in grammar.definitions}

    @staticmethod
    def _ebnf_name(name: str) -> str:
        return f"lark_{name}" if name in (_ROOT, _IGNORED) else name

    def emit(self) -> str:
        definitions = self.grammar.definitions
        rules = [name for name in definitions if not _is_terminal(name)]
        start = "start" if "start" in rules else rules[0]
        ending = f" {_IGNORED}" if self.grammar.ignored else ""
        lines = [f"{_ROOT} ::= {self.names[start]}{ending}"]
        for name, node in definitions.items():
            lines.append(f"{self.names[name]} ::= {self.expression(node, in_rule=not _is_terminal(name))}")
        if self.grammar.ignored:
            ignored = " | ".join(self.expression(node, in_rule=False) for node in self.grammar.ignored)
            lines.append(f"{_IGNORED} ::= ({ignored})*")
        return "\n".join(lines) + "\n"

    def expression(self, node: Node, in_rule: bool) -> str:
        kind = node[0]
        if kind == "alt":
            return "(" + " | ".join(self.expression(child, in_rule) for child in node[1]) + ")"
        if kind == "seq":
            return "(" + " ".join(self.expression(child, in_rule) for child in node[1]) + ")" if node[1] else '""'
        if kind == "repeat":
            return self.repeat(node, in_rule)
        if kind == "ref":
            return self.reference(node[1], in_rule)
        return self.token(self.terminal(node), in_rule)

    def repeat(self, node: Node, in_rule: bool) -> str:
        _, child, low, high = node
        inner = f"({self.expression(child, in_rule)})"
        if (low, high) == (0, 1):
            return inner + "?"
        if (low, high) == (0, None):
            return inner + "*"
        if (low, high) == (1, None):
            return inner + "+"
        if high is not None and high < low:
            raise ValueError(f"a Lark repetition ~ {low}..{high} has its bounds reversed")
        return f"{inner}{{{low}}}" if low == high else f"{inner}{{{low},{high}}}"

    def reference(self, name: str, in_rule: bool) -> str:
        if name not in self.names:
            hint = f" (add %import common.{name})" if name in _common().definitions else ""
            raise ValueError(f"the Lark grammar uses {name!r} but does not define it{hint}")
        if _is_terminal(name):
            return self.token(self.names[name], in_rule)
        if not in_rule:
            raise ValueError(f"the Lark terminal definitions use the rule {name!r} (terminals may use terminals only)")
        return self.names[name]

    def token(self, expression: str, in_rule: bool) -> str:
        """A token where a rule uses it: after whatever is ignored."""
        return f"({_IGNORED} {expression})" if in_rule and self.grammar.ignored else expression

    @staticmethod
    def terminal(node: Node) -> str:
        kind = node[0]
        if kind == "literal":
            _, text, case_insensitive = node
            if not text:
                return '""'
            if not case_insensitive:
                return _ebnf_string(text)
            return "(" + " ".join(_case_insensitive_char(c) for c in text) + ")"
        if kind == "range":
            return f"[{_class_char(node[1])}-{_class_char(node[2])}]"
        return _regexp_ebnf(node[1])


def _ebnf_string(text: str) -> str:
    return '"' + "".join(_string_char(c) for c in text) + '"'


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _string_char(c: str) -> str:
    if c in _ESCAPES:
        return _ESCAPES[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x20 else c


def _class_char(c: str) -> str:
    if c in "]\\^-":
        return "\\" + c
    return _string_char(c) if c not in '"' else c


def _case_insensitive_char(c: str) -> str:
    if c.lower() == c.upper():
        return _ebnf_string(c)
    return f"[{_class_char(c.lower())}{_class_char(c.upper())}]"


def _regexp_ebnf(pattern: str) -> str:
    try:
        from xgrammar.testing import _regex_to_ebnf
    except ImportError as exc:  # the converter moved in a newer xgrammar
        raise ValueError("this xgrammar cannot convert Lark's regular expressions") from exc
    try:
        return "(" + _regex_to_ebnf(pattern, with_rule_name=False).strip() + ")"
    except RuntimeError as exc:
        message = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(exc).strip().splitlines()[0])
        raise ValueError(f"the Lark regexp /{pattern}/ is not supported: {message}") from exc
