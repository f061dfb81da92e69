"""What the fuzzer's schema-valid cases become before they are sent: the few rules that a JSON
schema cannot state (they span fields, or need the model: a prompt that fits the context with
its max_tokens, a regex or grammar that compiles, a chat template that renders) are made to
hold, so that every positive case must be a 2xx. Each such rule has its own row in
`bad_inputs.py`. Cases are also kept small (n, max_tokens, prompt lengths) so that the run
stays bounded in time."""

from __future__ import annotations

import uuid
from typing import Any

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_choice")
_UNCHECKABLE_FIELDS = ("guided_regex", "guided_grammar", "chat_template", "chat_template_kwargs")
MAX_FUZZ_TOKENS = 4
MAX_FUZZ_N = 2
MAX_PROMPT_ITEMS = 4
MAX_TEXT_CHARS = 16
# 64-bit bounds (seeds): the schema's maximum is past a double's precision, so a generator that
# reads it as a double makes integers a little above it.
_INT64_FIELDS = ("seed", "truncate_prompt_tokens")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def fit_positive_body(path: str, body: Any, vocab_size: int) -> Any:
    """`body` (a schema-valid body for `path`) changed so that the server's cross-field and
    model-dependent rules hold."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if path in GENERATE_PATHS:
        _fit_sampling(body, vocab_size)
    if path in ("/v1/chat/completions", "/tokenize"):
        _fit_chat(body)
    if "prompt" in body:
        body["prompt"] = _short(body["prompt"])
    return body


def _fit_sampling(body: dict[str, Any], vocab_size: int) -> None:
    for name in _UNCHECKABLE_FIELDS:
        body.pop(name, None)
    structured = [name for name in _STRUCTURED_FIELDS if body.get(name) is not None]
    for name in structured[1:]:
        del body[name]  # at most one structured-output field
    if structured:
        _fit_structured(body, structured[0])
        body["ignore_eos"], body["min_tokens"] = False, 0  # a grammar's end must be able to stop
        body.pop("allowed_token_ids", None)  # a second mask, which could leave nothing to sample
    # stream_options only with a stream; prompt_logprobs only without one.
    body.pop("prompt_logprobs" if body.get("stream") else "stream_options", None)
    # Few new tokens, so that a prompt of the fuzzed lengths fits the context with them.
    max_tokens = body.get("max_tokens")
    body["max_tokens"] = MAX_FUZZ_TOKENS if max_tokens is None else min(max_tokens, MAX_FUZZ_TOKENS)
    if body.get("max_completion_tokens") is not None:
        body["max_completion_tokens"] = min(body["max_completion_tokens"], MAX_FUZZ_TOKENS)
    limit = body.get("max_completion_tokens") or body["max_tokens"]
    body["min_tokens"] = min(int(body.get("min_tokens") or 0), limit)
    body["n"] = min(int(body.get("n") or 1), MAX_FUZZ_N)
    for name in _INT64_FIELDS:
        if isinstance(body.get(name), int):
            body[name] = min(max(body[name], INT64_MIN), INT64_MAX)
    if body.get("request_id") is not None:
        # Unique: a request id still in use (the last case's, while its abort is on its way) is a 400.
        body["request_id"] = f"{str(body['request_id'])[:90]}-{uuid.uuid4().hex}"
    if body.get("logit_bias"):
        body["logit_bias"] = {k: v for k, v in body["logit_bias"].items() if k.isdigit() and int(k) < vocab_size}
    _fit_beam_search(body)


# What beam search cannot honour (it ranks by the raw logprobs), dropped from a beam-search body.
_NOT_WITH_BEAMS = (
    "stop",
    "stop_token_ids",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "top_p",
    "top_k",
    "min_p",
    "allowed_token_ids",
    "prompt_logprobs",
    *_STRUCTURED_FIELDS,
)


def _fit_beam_search(body: dict[str, Any]) -> None:
    """best_of and length_penalty only with use_beam_search, best_of at least n; a beam search
    without the fields it refuses, and with at least one token."""
    if not body.get("use_beam_search"):
        body.pop("best_of", None)
        body.pop("length_penalty", None)
        return
    for name in _NOT_WITH_BEAMS:
        body.pop(name, None)
    body["min_tokens"] = 0
    body.pop("echo", None)  # with logprobs: the prompt's, which a beam search does not compute
    if body.get("best_of") is not None:
        body["best_of"] = min(max(body["best_of"], body["n"]), MAX_FUZZ_N)
    body["max_tokens"] = max(body["max_tokens"], 1)


def _fit_structured(body: dict[str, Any], name: str) -> None:
    value = body[name]
    if name == "response_format" and value.get("type") == "json_schema":
        body[name] = {"type": "json_schema", "json_schema": {"name": "fuzz", "schema": {"type": "object"}}}
    elif name == "structured_outputs":
        kept = {key: value[key] for key in ("choice", "json_object") if value.get(key)}
        body[name] = dict([next(iter(kept.items()))]) if kept else None
    elif name == "guided_json":
        body[name] = {"type": "object"}


def _fit_chat(body: dict[str, Any]) -> None:
    body.pop("chat_template", None)
    body.pop("chat_template_kwargs", None)
    if body.get("messages") is not None:
        body["messages"] = [_short_message(m) for m in body["messages"][:MAX_PROMPT_ITEMS]]
    if body.get("continue_final_message"):
        # Continuing the last message: no generation prompt, and a text to continue.
        body["add_generation_prompt"] = False
        if body.get("messages") and not isinstance(body["messages"][-1].get("content"), str):
            body["messages"][-1]["content"] = "x"
    if body.get("tools"):
        body["tool_choice"] = "none"  # the fuzzed server has no tool-call parser
        body["tools"] = [
            {"type": "function", "function": {"name": tool["function"]["name"][:MAX_TEXT_CHARS], "parameters": {}}}
            for tool in body["tools"][:2]
        ]
    elif body.get("tool_choice") is not None:
        body["tool_choice"] = "none"


def _short_message(message: dict[str, Any]) -> dict[str, Any]:
    """The message's role and a short content (other keys could render to any length)."""
    short = {"role": message["role"]}
    content = message.get("content")
    if isinstance(content, str):
        short["content"] = content[:MAX_TEXT_CHARS]
    elif isinstance(content, list):
        short["content"] = [{"type": "text", "text": p["text"][:MAX_TEXT_CHARS]} for p in content[:MAX_PROMPT_ITEMS]]
    return short


def _short(prompt: Any) -> Any:
    if isinstance(prompt, str):
        return prompt[:MAX_TEXT_CHARS]
    if isinstance(prompt, list):
        return [_short(item) if isinstance(item, str | list) else item for item in prompt[:MAX_PROMPT_ITEMS]]
    return prompt
