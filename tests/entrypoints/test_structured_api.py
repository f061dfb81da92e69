"""Structured output, logit_bias, prompt scoring and /tokenizer_info on the session's demo-model
server, through the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.entrypoints.server_utils import ServerProcess

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name, an age and pets."}]


class Person(BaseModel):
    name: str
    age: int


def test_parse_returns_a_pydantic_object(client: openai.OpenAI, server: ServerProcess) -> None:
    completions = client.beta.chat.completions if hasattr(client, "beta") else client.chat.completions
    completion = completions.parse(
        model=server.model_name, messages=ASK, response_format=Person, max_tokens=32, temperature=0
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.age, int)


@pytest.mark.parametrize(
    ("route", "fields"),
    [
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}},
        ),
        ("completions", {"structured_outputs": {"json": PERSON_SCHEMA}}),
        ("completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON_SCHEMA}}}),
        ("chat", {"guided_json": PERSON_SCHEMA}),
    ],
)
def test_json_schema_on_both_routes(client: openai.OpenAI, server: ServerProcess, route: str, fields: dict) -> None:
    if route == "chat":
        chat = client.chat.completions.create(
            model=server.model_name, messages=ASK, max_tokens=40, temperature=0, extra_body=fields
        )
        text = chat.choices[0].message.content or ""
    else:
        completion = client.completions.create(
            model=server.model_name, prompt="A person as JSON:", max_tokens=40, temperature=0, extra_body=fields
        )
        text = completion.choices[0].text
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_a_streamed_structured_answer_validates(client: openai.OpenAI, server: ServerProcess) -> None:
    stream = client.chat.completions.create(
        model=server.model_name,
        messages=ASK,
        max_tokens=40,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_json_object(client: openai.OpenAI, server: ServerProcess) -> None:
    chat = client.chat.completions.create(
        model=server.model_name, messages=ASK, max_tokens=40, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)


def test_choice_and_regex(client: openai.OpenAI, server: ServerProcess) -> None:
    choices = ["yes", "no", "it depends"]
    chat = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Is the sea salty?"}],
        max_tokens=6,
        temperature=1.0,
        seed=3,
        n=3,
        extra_body={"guided_choice": choices},
    )
    assert all(c.message.content in choices for c in chat.choices)
    pattern = r"\d{3}-\d{3}-\d{4}"
    completion = client.completions.create(
        model=server.model_name,
        prompt="Call me at",
        max_tokens=16,
        temperature=0,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, completion.choices[0].text)


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
            "invalid JSON schema",
        ),
        ("completions", {"guided_regex": "(unclosed"}, "invalid regex"),
        ("completions", {"guided_grammar": "start ::= x"}, "invalid grammar"),
        ("chat", {"guided_choice": ["a"], "guided_regex": "a"}, "at most one"),
        ("chat", {"response_format": {"type": "xml"}}, "response_format"),
        ("chat", {"structured_outputs": {"jsn": {}}}, "jsn"),
        ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("completions", {"logit_bias": {"five": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"999999": 1}}, "out of the vocabulary"),
    ],
)
def test_bad_requests_get_a_400_and_the_server_keeps_serving(
    server: ServerProcess, route: str, body: dict, message: str
) -> None:
    if route == "chat":
        url, request = "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body}
    else:
        url, request = "/v1/completions", {"prompt": "Hi", "max_tokens": 4, **body}
    response = httpx.post(server.url + url, json=request, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_structured_requests_leave_free_greedy_outputs_unchanged(server: ServerProcess) -> None:
    free = [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in ("The capital of France is", "1, 2, 3,")]
    structured = [
        {"prompt": f"Person {i}:", "max_tokens": 40, "temperature": 0.7, "seed": i, "guided_json": PERSON_SCHEMA}
        for i in range(2)
    ]

    async def run(bodies: list[dict]) -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            responses = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
        return [r.json() for r in responses]

    alone = asyncio.run(run(free))
    together = asyncio.run(run(structured + free))
    assert [r["choices"][0]["text"] for r in together[len(structured) :]] == [r["choices"][0]["text"] for r in alone]
    for response in together[: len(structured)]:
        jsonschema.validate(json.loads(response["choices"][0]["text"]), PERSON_SCHEMA)


def test_logit_bias_on_both_routes(client: openai.OpenAI, server: ServerProcess) -> None:
    token = httpx.post(f"{server.url}/tokenize", json={"prompt": " banana"}, timeout=30).json()["tokens"][0]
    bias = {str(token): 100}
    completion = client.completions.create(
        model=server.model_name,
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        logit_bias=bias,
        extra_body={"ignore_eos": True},
    )
    assert (
        completion.choices[0].text
        == client.completions.create(model=server.model_name, prompt="x", max_tokens=1, temperature=0, logit_bias=bias)
        .choices[0]
        .text
        * 4
    )
    chat = client.chat.completions.create(
        model=server.model_name,
        messages=ASK,
        max_tokens=3,
        temperature=0,
        logit_bias=bias,
        extra_body={"ignore_eos": True},
    )
    assert (
        chat.usage.completion_tokens == 3
        and chat.choices[0].message.content == completion.choices[0].text[: len(chat.choices[0].message.content or "")]
    )


def test_max_tokens_0_scores_the_prompt(client: openai.OpenAI, server: ServerProcess) -> None:
    prompt = "The capital of France is Paris."
    scored = client.completions.create(model=server.model_name, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    one = client.completions.create(
        model=server.model_name, prompt=prompt, max_tokens=1, echo=True, logprobs=2, temperature=0
    )
    choice = scored.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    num_prompt_tokens = scored.usage.prompt_tokens
    assert choice.logprobs is not None and one.choices[0].logprobs is not None
    assert choice.logprobs.tokens == one.choices[0].logprobs.tokens[:num_prompt_tokens]
    assert choice.logprobs.token_logprobs == pytest.approx(one.choices[0].logprobs.token_logprobs[:num_prompt_tokens])
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == num_prompt_tokens


def test_tokenizer_info(server: ServerProcess) -> None:
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]
    assert info["tokenizer_class"]


# vLLM's tests' SQL grammar, in Lark (as vLLM's clients send `guided_grammar`).
SQL_LARK = """
start: select_statement
select_statement: "SELECT" column "from" table "where" condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column "=" number
number: "1" | "2"
"""


def test_lark_grammars_on_both_routes(client: openai.OpenAI, server: ServerProcess) -> None:
    import lark

    completion = client.completions.create(
        model=server.model_name,
        prompt="Generate an SQL statement that shows col_1 of table_1 where col_2 is 1:",
        max_tokens=24,
        temperature=0,
        extra_body={"guided_grammar": SQL_LARK},
    )
    lark.Lark(SQL_LARK).parse(completion.choices[0].text)
    chat = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Write an SQL select statement."}],
        max_tokens=24,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": SQL_LARK}},
    )
    lark.Lark(SQL_LARK).parse(chat.choices[0].message.content)
    bad = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Hi", "max_tokens": 4, "guided_grammar": "start: x\n%declare x"},
        timeout=60,
    )
    assert bad.status_code == 400
    assert "%declare" in bad.json()["error"]["message"]
