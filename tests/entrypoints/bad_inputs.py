"""Every bad input tried against the server, with the status it gets: the table that
docs/bad_inputs.md shows (`python -m tests.entrypoints.bad_inputs > docs/bad_inputs.md` writes
it; test_bad_inputs.py checks that the file is in sync) and test_bad_inputs.py runs, row by
row, against the session's demo-model server (max_model_len 1024, a 256 MiB KV cache).

A body is JSON (a Python value) or raw bytes, sent as they are with Content-Type JSON: raw
bytes carry what Python's JSON encoder would not write (lone surrogates, NaN, invalid UTF-8)."""

from __future__ import annotations

from typing import Any, NamedTuple

from tests.entrypoints.server_utils import DEMO_MAX_MODEL_LEN

DEMO_VOCAB_SIZE = 49152
CHAT = [{"role": "user", "content": "Hi"}]
C = "/v1/completions"
CC = "/v1/chat/completions"


class BadInput(NamedTuple):
    what: str
    method: str
    path: str
    body: Any  # None: no body; bytes: sent raw
    status: int
    message: str  # a part of the error's message ("" for a 2xx)
    headers: tuple[str, ...] = ()  # response headers that must be present


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


def _completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": CHAT, "max_tokens": 2, **fields}


BAD_INPUTS = [
    # ---- bodies that are not the JSON object a route takes
    BadInput("truncated JSON", "POST", C, b'{"prompt": "hi", "max_tokens": 5', 400, "not valid JSON"),
    BadInput("not JSON at all", "POST", C, b"not json at all", 400, "not valid JSON"),
    BadInput("a JSON array, not an object", "POST", C, [], 400, "must be a JSON object, not an array"),
    BadInput("a JSON string, not an object", "POST", C, "hi", 400, "must be a JSON object, not a string"),
    BadInput("no body", "POST", C, None, 400, "must be a JSON object; this request has none"),
    BadInput("invalid UTF-8 bytes", "POST", C, b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, "parsing the body"),
    BadInput("100000 nested arrays", "POST", C, b"[" * 100_000 + b"]" * 100_000, 400, "parsing the body"),
    BadInput("a schema nested 100 deep", "POST", C, _completion(guided_json=_nested(100)), 400, "nested more than"),
    BadInput("a body over the 10 MiB limit", "POST", C, _completion(prompt="x" * 11 * 1024**2), 413, "larger than"),
    # ---- text that cannot become UTF-8
    BadInput(
        "a lone surrogate and a NUL in the prompt",
        "POST",
        C,
        b'{"prompt": "\\udcff\\u0000 hi", "max_tokens": 2}',
        400,
        "lone surrogate",
    ),
    BadInput("a lone surrogate in a prompt list", "POST", C, b'{"prompt": ["\\ud800"]}', 400, "lone surrogate"),
    BadInput(
        "a lone surrogate in a chat message",
        "POST",
        CC,
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "lone surrogate",
    ),
    BadInput(
        "a lone surrogate in a stop string", "POST", C, b'{"prompt": "hi", "stop": ["\\udfff"]}', 400, "surrogate"
    ),
    BadInput("a lone surrogate in a key", "POST", C, b'{"prompt": "hi", "\\ud800": 1}', 400, "lone surrogate"),
    BadInput("a lone surrogate to /tokenize", "POST", "/tokenize", b'{"prompt": "\\ud800"}', 400, "lone surrogate"),
    BadInput(
        "a lone surrogate in a streamed request",
        "POST",
        C,
        b'{"prompt": "\\ud800", "stream": true}',
        400,
        "lone surrogate",
    ),
    BadInput("a NUL in the prompt (valid Unicode: served)", "POST", C, _completion(prompt="a\x00b"), 200, ""),
    BadInput("unicode stop strings (served)", "POST", C, _completion(stop=["é", "☃", "😀", "\u200b"]), 200, ""),
    # ---- prompts
    BadInput("prompt of the wrong type", "POST", C, {"prompt": 5}, 400, "prompt"),
    BadInput("prompt missing", "POST", C, {"max_tokens": 5}, 400, "prompt"),
    BadInput("prompt null", "POST", C, {"prompt": None}, 400, "prompt"),
    BadInput("empty prompt", "POST", C, {"prompt": ""}, 400, "at least 1"),
    BadInput("empty prompt list", "POST", C, {"prompt": []}, 400, "at least 1"),
    BadInput("an empty list among token lists", "POST", C, {"prompt": [[1, 2], []]}, 400, "at least 1"),
    BadInput("a token id past the vocabulary", "POST", C, {"prompt": [1, DEMO_VOCAB_SIZE]}, 400, "vocabulary"),
    BadInput("a token id past 32 bits", "POST", C, {"prompt": [1, 10**12]}, 400, "prompt"),
    BadInput("a negative token id", "POST", C, {"prompt": [-1]}, 400, "prompt"),
    BadInput("prompt past the context", "POST", C, {"prompt": "hi " * 1200, "max_tokens": 4}, 400, "context length"),
    BadInput(
        "max_tokens past the context", "POST", C, _completion(max_tokens=DEMO_MAX_MODEL_LEN), 400, "context length"
    ),
    # ---- numbers out of range
    BadInput("max_tokens of the wrong type", "POST", C, _completion(max_tokens="five"), 400, "max_tokens"),
    BadInput("negative max_tokens", "POST", C, _completion(max_tokens=-1), 400, "max_tokens"),
    BadInput("negative max_tokens, streamed", "POST", C, _completion(max_tokens=-1, stream=True), 400, "max_tokens"),
    BadInput("max_tokens 10**30", "POST", C, _completion(max_tokens=10**30), 400, "max_tokens"),
    BadInput("temperature below 0", "POST", C, _completion(temperature=-1.0), 400, "temperature"),
    BadInput("temperature NaN", "POST", C, b'{"prompt": "hi", "temperature": NaN}', 400, "finite"),
    BadInput("temperature Infinity", "POST", C, b'{"prompt": "hi", "temperature": Infinity}', 400, "finite"),
    BadInput("temperature 1e999 (infinite)", "POST", C, b'{"prompt": "hi", "temperature": 1e999}', 400, "finite"),
    BadInput("top_p 0", "POST", C, _completion(top_p=0.0), 400, "top_p"),
    BadInput("top_p above 1", "POST", C, _completion(top_p=1.5), 400, "top_p"),
    BadInput("top_k -5", "POST", C, _completion(top_k=-5), 400, "top_k"),
    BadInput("top_k 2**40", "POST", C, _completion(top_k=2**40), 400, "top_k"),
    BadInput("min_p above 1", "POST", C, _completion(min_p=2.0), 400, "min_p"),
    BadInput("presence_penalty 1e300", "POST", C, _completion(presence_penalty=1e300), 400, "presence_penalty"),
    BadInput("repetition_penalty 0", "POST", C, _completion(repetition_penalty=0), 400, "repetition_penalty"),
    BadInput("seed 2**63 (past 64-bit signed)", "POST", C, _completion(seed=2**63), 400, "seed"),
    BadInput("seed below -2**63", "POST", C, _completion(seed=-(2**63) - 1), 400, "seed"),
    BadInput("seed -1 (served: any 64-bit signed seed)", "POST", C, _completion(seed=-1), 200, ""),
    BadInput("min_tokens above max_tokens", "POST", C, _completion(min_tokens=5), 400, "min_tokens"),
    BadInput("min_tokens 10**11", "POST", C, _completion(min_tokens=10**11), 400, "min_tokens"),
    BadInput("n 0", "POST", C, _completion(n=0), 400, "n"),
    BadInput("n 129", "POST", C, _completion(n=129), 400, "n"),
    BadInput("n × max_tokens past the KV cache", "POST", C, _completion(n=16, max_tokens=1000), 400, "KV-cache blocks"),
    BadInput("logprobs 50", "POST", C, _completion(logprobs=50), 400, "logprobs"),
    BadInput("logprobs true on /v1/completions", "POST", C, _completion(logprobs=True), 400, "logprobs"),
    BadInput(
        "prompt_logprobs -1 (the whole vocabulary)", "POST", C, _completion(prompt_logprobs=-1), 400, "vocabulary"
    ),
    BadInput("prompt_logprobs in a stream", "POST", C, _completion(prompt_logprobs=1, stream=True), 400, "stream"),
    BadInput("truncate_prompt_tokens 0", "POST", C, _completion(truncate_prompt_tokens=0), 400, "at least 1"),
    BadInput("an empty allowed_token_ids", "POST", C, _completion(allowed_token_ids=[]), 400, "allowed_token_ids"),
    BadInput(
        "allowed_token_ids past the vocabulary",
        "POST",
        C,
        _completion(allowed_token_ids=[DEMO_VOCAB_SIZE]),
        400,
        "vocabulary",
    ),
    BadInput(
        "allowed_token_ids with a structured output",
        "POST",
        C,
        _completion(allowed_token_ids=[1], guided_choice=["a"]),
        400,
        "allowed_token_ids",
    ),
    BadInput("stream_options without stream", "POST", C, _completion(stream_options={}), 400, "stream_options"),
    BadInput("logit_bias value 500", "POST", C, _completion(logit_bias={"42": 500.0}), 400, "logit_bias"),
    BadInput("logit_bias key not a token id", "POST", C, _completion(logit_bias={"abc": 1.0}), 400, "logit_bias"),
    BadInput("logit_bias key past 32 bits", "POST", C, _completion(logit_bias={"1" * 20: 1.0}), 400, "logit_bias"),
    BadInput(
        "logit_bias key past the vocabulary",
        "POST",
        C,
        _completion(logit_bias={str(DEMO_VOCAB_SIZE): 1.0}),
        400,
        "vocabulary",
    ),
    BadInput("an empty stop string", "POST", C, _completion(stop=[""]), 400, "stop"),
    BadInput("stop_token_ids past 32 bits", "POST", C, _completion(stop_token_ids=[10**12]), 400, "stop_token_ids"),
    BadInput(
        "stop_token_ids past the vocabulary",
        "POST",
        C,
        _completion(stop_token_ids=[DEMO_VOCAB_SIZE]),
        400,
        "vocabulary",
    ),
    # ---- structured output and tools
    BadInput("tools on /v1/completions", "POST", C, _completion(tools=[]), 400, "only for /v1/chat/completions"),
    BadInput(
        "response_format of an unknown type", "POST", C, _completion(response_format={"type": "xml"}), 400, "type"
    ),
    BadInput(
        "a JSON schema that is not one",
        "POST",
        C,
        _completion(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}),
        400,
        "JSON schema",
    ),
    BadInput("an unknown structured_outputs key", "POST", C, _completion(structured_outputs={"jsn": {}}), 400, "jsn"),
    BadInput(
        "two structured-output fields",
        "POST",
        C,
        _completion(guided_regex="a+", guided_choice=["a"]),
        400,
        "at most one",
    ),
    BadInput("a regex that does not compile", "POST", C, _completion(guided_regex="(("), 400, "regex"),
    BadInput("a grammar that does not compile", "POST", C, _completion(guided_grammar="::="), 400, "grammar"),
    BadInput("an empty guided_choice", "POST", C, _completion(guided_choice=[]), 400, "guided_choice"),
    BadInput("a guided_choice with a NUL", "POST", C, _completion(guided_choice=["a\x00b"]), 400, "guided_choice"),
    BadInput("tool_choice of an unknown kind", "POST", CC, _chat(tool_choice="sometimes"), 400, "tool_choice"),
    BadInput("tool_choice without tools", "POST", CC, _chat(tool_choice="required"), 400, "needs tools"),
    BadInput("a tool without a name", "POST", CC, _chat(tools=[{"type": "function", "function": {}}]), 400, "name"),
    # ---- beam search
    BadInput("use_beam_search with stop", "POST", C, _completion(use_beam_search=True, stop=["."]), 400, "stop"),
    BadInput("best_of below n", "POST", C, _completion(use_beam_search=True, n=2, best_of=1), 400, "at least n"),
    BadInput(
        "use_beam_search with echo and logprobs",
        "POST",
        C,
        _completion(use_beam_search=True, echo=True, logprobs=1),
        400,
        "echo with logprobs",
    ),
    BadInput("11 beams", "POST", C, _completion(use_beam_search=True, n=11), 400, "at most 10 beams"),
    BadInput("best_of without use_beam_search", "POST", C, _completion(best_of=2), 400, "needs use_beam_search"),
    BadInput("length_penalty without use_beam_search", "POST", CC, _chat(length_penalty=2.0), 400, "needs use_beam"),
    # ---- chat
    BadInput("messages not a list", "POST", CC, {"messages": "hi"}, 400, "messages"),
    BadInput("no messages", "POST", CC, {"messages": []}, 400, "at least 1"),
    BadInput("a message that is not an object", "POST", CC, {"messages": [5]}, 400, "messages.0"),
    BadInput("a message without a role", "POST", CC, {"messages": [{"content": "no role"}]}, 400, "role"),
    BadInput(
        "a custom role (served: the template gets it)",
        "POST",
        CC,
        _chat(messages=[{"role": "x", "content": "y"}]),
        200,
        "",
    ),
    BadInput("an empty role", "POST", CC, {"messages": [{"role": "", "content": "x"}]}, 400, "role"),
    BadInput("content of the wrong type", "POST", CC, {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    BadInput(
        "an image content part",
        "POST",
        CC,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "text",
    ),
    BadInput("top_logprobs without logprobs", "POST", CC, _chat(top_logprobs=2), 400, "logprobs"),
    BadInput(
        "top_logprobs -1 (the whole vocabulary)", "POST", CC, _chat(logprobs=True, top_logprobs=-1), 400, "vocabulary"
    ),
    BadInput(
        "continue_final_message with add_generation_prompt",
        "POST",
        CC,
        _chat(continue_final_message=True, add_generation_prompt=True),
        400,
        "cannot both be true",
    ),
    BadInput("a vLLM field shoal does not implement", "POST", CC, _chat(bad_words=["x"]), 400, "not supported"),
    BadInput("stream_options without stream on chat", "POST", CC, _chat(stream_options={}), 400, "stream_options"),
    BadInput("max_tokens 0 on chat", "POST", CC, _chat(max_tokens=0), 400, "max_tokens"),
    BadInput(
        "max_tokens past the context beside max_completion_tokens",
        "POST",
        CC,
        _chat(max_tokens=DEMO_MAX_MODEL_LEN, max_completion_tokens=2),
        400,
        "max_tokens",
    ),
    BadInput(
        "messages past the context",
        "POST",
        CC,
        {"messages": [{"role": "user", "content": "hi " * 1200}]},
        400,
        "context length",
    ),
    BadInput("a chat template that raises", "POST", CC, _chat(chat_template="{{ 1/0 }}"), 400, "chat template"),
    BadInput("a chat template that does not parse", "POST", CC, _chat(chat_template="{% for %}"), 400, "chat template"),
    BadInput(
        "chat_template_kwargs that clash",
        "POST",
        CC,
        _chat(chat_template_kwargs={"messages": 1}),
        400,
        "chat template",
    ),
    # ---- models
    BadInput("an unknown model", "POST", C, _completion(model="no-such-model"), 404, "does not exist"),
    BadInput("an unknown model on chat", "POST", CC, _chat(model="gpt-4o"), 404, "does not exist"),
    BadInput("a model name of 2000 characters", "GET", "/v1/models/" + "m" * 2000, None, 400, "at most"),
    # ---- tokenizer routes
    BadInput("/tokenize with neither prompt nor messages", "POST", "/tokenize", {}, 400, "exactly one"),
    BadInput(
        "/tokenize with both prompt and messages",
        "POST",
        "/tokenize",
        {"prompt": "hi", "messages": CHAT},
        400,
        "exactly one",
    ),
    BadInput("/tokenize with no messages", "POST", "/tokenize", {"messages": []}, 400, "at least 1"),
    BadInput("/detokenize a negative id", "POST", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    BadInput("/detokenize an id past 32 bits", "POST", "/detokenize", {"tokens": [10**12]}, 400, "tokens"),
    BadInput(
        "/detokenize an id past the vocabulary", "POST", "/detokenize", {"tokens": [DEMO_VOCAB_SIZE]}, 400, "vocab"
    ),
    # ---- routes and methods
    BadInput("an unknown route", "POST", "/v1/no-such-route", {}, 404, "Not found"),
    BadInput("GET on a POST route", "GET", C, None, 405, "Method Not Allowed", ("Allow",)),
    BadInput("TRACE", "TRACE", C, None, 405, "Method Not Allowed", ("Allow",)),
    BadInput("DELETE /health", "DELETE", "/health", None, 405, "Method Not Allowed", ("Allow",)),
]


def _shown(body: Any) -> str:
    if body is None:
        return ""
    text = body.decode("utf-8", "backslashreplace") if isinstance(body, bytes) else _json(body)
    text = text if len(text) <= 90 else f"{text[:80]} … ({len(text)} bytes)"
    return f"`{text}`".replace("|", "\\|")


def _json(body: Any) -> str:
    import json

    return json.dumps(body, ensure_ascii=True)


def markdown() -> str:
    """docs/bad_inputs.md."""
    lines = [
        "# Bad inputs",
        "",
        "Every bad input tried against `shoal serve` and what it answers: a 4xx with an OpenAI error body",
        '(`{"error": {"message", "type", "param", "code"}}`), never a 5xx, and nothing else changes (the',
        "next request is served as usual). Each row is a test (`tests/entrypoints/test_bad_inputs.py`, on",
        "the demo model: a 1024-token context, a 256 MiB KV cache); the table is generated from",
        "`tests/entrypoints/bad_inputs.py` (`python -m tests.entrypoints.bad_inputs > docs/bad_inputs.md`).",
        "",
        "Four rows are served (200) on purpose: a NUL is valid Unicode (UTF-8 byte 0, which byte-level",
        "tokenizers encode like any other byte), and stop strings may hold any Unicode (a lone surrogate",
        "is what cannot be encoded); a seed is any signed 64-bit integer and a role any name the chat",
        "template gets, as OpenAI and vLLM take them. The OpenAPI schema (`/openapi.json`) states the",
        "same rules where a JSON schema can: see docs/serving_limits.md for the fuzzing that checks it.",
        "",
        "| input | request | status | the answer says |",
        "|---|---|---|---|",
    ]
    for row in BAD_INPUTS:
        request = f"`{row.method} {row.path if len(row.path) < 40 else row.path[:30] + '…'}` {_shown(row.body)}"
        said = row.message + (f" (headers: {', '.join(row.headers)})" if row.headers else "")
        lines.append(f"| {row.what} | {request.strip()} | {row.status} | {said} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
