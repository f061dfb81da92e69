"""`StructuredOutputsParams`: what a request's output must match, with vLLM's field names.

Exactly one of `json` (a JSON schema), `regex`, `choice` (one of these strings), `grammar` (EBNF,
GBNF-style) or `json_object` (any JSON object) is given. It is a `msgspec.Struct` so that it
travels inside `SamplingParams` to the engine core, where the grammar is compiled.
"""

from __future__ import annotations

import json as jsonlib
from typing import Any

import msgspec

KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A constraint on a request's output (`SamplingParams.structured_outputs`).

    `json` may be a dict or its JSON text; it is kept as compact text (the key of the grammar
    cache). `disable_any_whitespace` (default True, unlike vLLM) keeps JSON to the standard
    separators (", " and ": ") with no free whitespace, which small models otherwise fill without
    end; False allows any whitespace between tokens.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    # A reasoning model's thinking, which the constraint leaves free (set by the server's
    # reasoning parser). With `reasoning_end_token_ids`, the constraint applies after the output
    # contains them; None: from the first token. With `reasoning_start_token_id` too, the model
    # opens its thinking itself: the first token may be that one (then the thinking runs until
    # the end tokens) or one the grammar allows (then the constraint applies from it on).
    # Without it, the prompt opened the thinking: the output starts inside it.
    reasoning_end_token_ids: list[int] | None = None
    reasoning_start_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = jsonlib.dumps(self.json, separators=(",", ":"), sort_keys=False)
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise ValueError(f"StructuredOutputsParams needs exactly one of {', '.join(KINDS)}; got {named}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: (kind, spec text, whitespace rule)."""
        kind = self.kind
        spec = getattr(self, kind)
        text = spec if isinstance(spec, str) else jsonlib.dumps(spec)
        return kind, text, self.disable_any_whitespace
