"""vLLM's request fields on the session's demo-model server, through the official `openai` client
(`extra_body`): token ids and token-id names in responses, prompt logprobs, prompt truncation,
allowed_token_ids, custom roles, chat echo and continue_final_message, what shoal refuses (a 400
naming the field), seeds over the signed 64-bit range, stream_options, the model's name."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from shoal.demo_model import DEMO_MODEL_NAME
from tests.entrypoints.server_utils import ServerProcess

PROMPT = "The capital of France is"
LONG_PROMPT = "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve"
CONVERSATION = [{"role": "user", "content": "What is the capital of France?"}]
SAYING = "An apple a day keeps the"


def tokenize(server: ServerProcess, **body: Any) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json=body, timeout=60).json()["tokens"]


def detokenize(server: ServerProcess, tokens: list[int]) -> str:
    return httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]


def bad_request(call: Any) -> dict[str, Any]:
    """The error (`message`, `param`, ...) of a call that must be a 400."""
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body = info.value.body
    assert isinstance(body, dict)
    return body


# ---- the served model, seeds, stream_options ----------------------------------------------------


def test_the_demo_model_is_listed_by_its_name(client: openai.OpenAI, server: ServerProcess) -> None:
    """The session's server gets the demo model's folder by its path; it answers to its name."""
    [card] = client.models.list().data
    assert card.id == server.model_name == DEMO_MODEL_NAME
    assert card.model_extra is not None and card.model_extra["root"].endswith(DEMO_MODEL_NAME)
    assert client.completions.create(model=DEMO_MODEL_NAME, prompt=PROMPT, max_tokens=1).choices


@pytest.mark.parametrize("seed", [-1, 2**63 - 1, -(2**63)])
def test_any_signed_64_bit_seed_samples_deterministically(
    client: openai.OpenAI, server: ServerProcess, seed: int
) -> None:
    def sample() -> list[str]:
        response = client.completions.create(
            model=server.model_name, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=seed, n=2
        )
        return [choice.text for choice in response.choices]

    assert sample() == sample()
    chat = client.chat.completions.create(
        model=server.model_name, messages=CONVERSATION, max_tokens=2, temperature=1.0, seed=seed
    )
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_seeds_outside_64_bits_are_refused(client: openai.OpenAI, server: ServerProcess) -> None:
    for seed in (2**63, -(2**63) - 1):
        error = bad_request(lambda s=seed: client.completions.create(model=server.model_name, prompt=PROMPT, seed=s))
        assert error["param"] == "seed"


def test_stream_options_need_a_stream(client: openai.OpenAI, server: ServerProcess) -> None:
    options = {"include_usage": True}
    error = bad_request(
        lambda: client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=2, stream_options=options)  # type: ignore[call-overload]
    )
    assert error["param"] == "stream_options"
    error = bad_request(
        lambda: client.chat.completions.create(  # type: ignore[call-overload]
            model=server.model_name, messages=CONVERSATION, max_tokens=2, stream_options=options
        )
    )
    assert error["param"] == "stream_options"


@pytest.mark.parametrize(
    ("options", "every_chunk", "at_the_end"),
    [
        ({"include_usage": False, "continuous_usage_stats": True}, False, False),
        ({"include_usage": True, "continuous_usage_stats": True}, True, True),
        ({"continuous_usage_stats": True}, True, True),
        ({"include_usage": True}, False, True),
    ],
)
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_only_with_include_usage(
    client: openai.OpenAI,
    server: ServerProcess,
    options: dict[str, bool],
    every_chunk: bool,
    at_the_end: bool,
    route: str,
) -> None:
    if route == "completions":
        chunks = list(
            client.completions.create(
                model=server.model_name, prompt=PROMPT, max_tokens=3, stream=True, stream_options=options
            )
        )
    else:
        chunks = list(
            client.chat.completions.create(  # type: ignore[call-overload]
                model=server.model_name, messages=CONVERSATION, max_tokens=3, stream=True, stream_options=options
            )
        )
    with_choices = [chunk for chunk in chunks if chunk.choices]
    usage_only = [chunk for chunk in chunks if not chunk.choices]
    assert all((chunk.usage is not None) == every_chunk for chunk in with_choices)
    assert len(usage_only) == int(at_the_end)
    if at_the_end:
        assert usage_only[0].usage is not None and usage_only[0].usage.completion_tokens == 3


# ---- token ids in responses -----------------------------------------------------------------------


def test_completion_token_ids(client: openai.OpenAI, server: ServerProcess) -> None:
    extra = {"return_token_ids": True}
    response = client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=4, temperature=0, extra_body=extra
    )
    choice = response.choices[0]
    assert choice.prompt_token_ids == tokenize(server, prompt=PROMPT)  # type: ignore[attr-defined]
    assert len(choice.token_ids) == response.usage.completion_tokens == 4  # type: ignore[attr-defined, union-attr]
    assert detokenize(server, choice.token_ids) == choice.text  # type: ignore[attr-defined]
    stream = client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=4, temperature=0, stream=True, extra_body=extra
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert chunks[0].prompt_token_ids == choice.prompt_token_ids  # type: ignore[attr-defined]
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert [t for c in chunks for t in c.token_ids] == choice.token_ids  # type: ignore[attr-defined]


def test_chat_token_ids(client: openai.OpenAI, server: ServerProcess) -> None:
    extra = {"return_token_ids": True}
    kwargs: dict[str, Any] = dict(model=server.model_name, messages=CONVERSATION, max_tokens=4, temperature=0)
    response = client.chat.completions.create(extra_body=extra, **kwargs)
    assert response.prompt_token_ids == tokenize(server, messages=CONVERSATION)  # type: ignore[attr-defined]
    token_ids = response.choices[0].token_ids  # type: ignore[attr-defined]
    assert len(token_ids) == 4 and detokenize(server, token_ids) == response.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, extra_body=extra, **kwargs))
    assert chunks[0].prompt_token_ids == response.prompt_token_ids  # type: ignore[attr-defined]
    assert [t for c in chunks for t in (getattr(c.choices[0], "token_ids", None) or [])] == token_ids


def test_token_ids_are_left_out_unless_asked_for(server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2}
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert not {"prompt_token_ids", "token_ids", "prompt_logprobs"} & set(choice)
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CONVERSATION, "max_tokens": 2}).json()
    assert not {"prompt_token_ids", "prompt_logprobs"} & set(chat) and "token_ids" not in chat["choices"][0]


def test_tokens_as_token_ids(client: openai.OpenAI, server: ServerProcess) -> None:
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    choice = client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True, extra_body=extra
    ).choices[0]
    ids = choice.prompt_token_ids + choice.token_ids  # type: ignore[attr-defined]
    assert choice.logprobs is not None and choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in choice.logprobs.top_logprobs[1:] or [] for k in top)
    # Offsets still count the text, which starts with the echoed prompt.
    assert choice.logprobs.text_offset[len(choice.prompt_token_ids)] == len(PROMPT)  # type: ignore[attr-defined]
    chat = client.chat.completions.create(
        model=server.model_name,
        messages=CONVERSATION,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=extra,
    ).choices[0]
    assert chat.logprobs is not None and chat.logprobs.content is not None
    assert [c.token for c in chat.logprobs.content] == [f"token_id:{t}" for t in chat.token_ids]  # type: ignore[attr-defined]
    assert all(top.token.startswith("token_id:") for c in chat.logprobs.content for top in c.top_logprobs)


# ---- prompt logprobs --------------------------------------------------------------------------------


def test_completion_prompt_logprobs_agree_with_echo(client: openai.OpenAI, server: ServerProcess) -> None:
    choice = client.completions.create(
        model=server.model_name,
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"prompt_logprobs": 3, "return_token_ids": True},
    ).choices[0]
    prompt_ids = choice.prompt_token_ids  # type: ignore[attr-defined]
    rows = choice.prompt_logprobs  # type: ignore[attr-defined]
    assert len(rows) == len(prompt_ids) and rows[0] is None
    assert choice.logprobs is not None
    for position, (token_id, row) in enumerate(zip(prompt_ids[1:], rows[1:]), start=1):
        assert str(token_id) in row and 1 <= len(row) <= 4  # the prompt's token and the top 3
        assert sorted(entry["rank"] for entry in row.values())[:3] == [1, 2, 3]
        assert row[str(token_id)]["logprob"] == pytest.approx(choice.logprobs.token_logprobs[position], abs=1e-4)
        # The echoed logprobs' top_logprobs keep to logprobs=1 (+ the prompt's token).
        assert len(choice.logprobs.top_logprobs[position] or {}) <= 2


def test_chat_prompt_logprobs_agree_with_completions(client: openai.OpenAI, server: ServerProcess) -> None:
    chat = client.chat.completions.create(
        model=server.model_name,
        messages=CONVERSATION,
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 0, "return_token_ids": True},
    )
    prompt_ids = chat.prompt_token_ids  # type: ignore[attr-defined]
    completion = client.completions.create(
        model=server.model_name, prompt=prompt_ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    ).choices[0]
    rows, expected = chat.prompt_logprobs, completion.prompt_logprobs  # type: ignore[attr-defined]
    assert rows[0] is None and len(rows) == len(prompt_ids) == len(expected)
    for token_id, row, other in zip(prompt_ids[1:], rows[1:], expected[1:]):
        assert row[str(token_id)]["logprob"] == pytest.approx(other[str(token_id)]["logprob"], abs=1e-4)


def test_chat_echo_with_top_logprobs_gives_prompt_logprobs(client: openai.OpenAI, server: ServerProcess) -> None:
    response = client.chat.completions.create(
        model=server.model_name,
        messages=CONVERSATION,
        max_tokens=1,
        logprobs=True,
        top_logprobs=2,
        extra_body={"echo": True},
    )
    rows = response.prompt_logprobs  # type: ignore[attr-defined]
    assert rows[0] is None and len(rows) == len(tokenize(server, messages=CONVERSATION))
    assert all(1 <= len(row) <= 3 for row in rows[1:])


def test_logprobs_of_the_whole_vocabulary_are_refused(client: openai.OpenAI, server: ServerProcess) -> None:
    def chat(**extra: Any) -> Any:
        return client.chat.completions.create(
            model=server.model_name, messages=CONVERSATION, max_tokens=1, logprobs=True, extra_body=extra
        )

    for field in ("top_logprobs", "prompt_logprobs"):
        error = bad_request(lambda f=field: chat(**{f: -1}))
        assert error["param"] == field and "every token of the vocabulary" in error["message"]
    stream_error = bad_request(
        lambda: client.completions.create(
            model=server.model_name, prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1}
        )
    )
    assert stream_error["param"] == "prompt_logprobs"


# ---- prompt truncation, allowed tokens -------------------------------------------------------------


@pytest.mark.parametrize(("side", "keep"), [(None, slice(-5, None)), ("left", slice(-5, None)), ("right", slice(5))])
def test_truncate_prompt_tokens(client: openai.OpenAI, server: ServerProcess, side: str | None, keep: slice) -> None:
    extra: dict[str, Any] = {"truncate_prompt_tokens": 5, "return_token_ids": True}
    if side is not None:
        extra["truncation_side"] = side
    response = client.completions.create(
        model=server.model_name, prompt=LONG_PROMPT, max_tokens=1, echo=True, extra_body=extra
    )
    kept = tokenize(server, prompt=LONG_PROMPT)[keep]
    assert response.usage is not None and response.usage.prompt_tokens == 5
    assert response.choices[0].prompt_token_ids == kept  # type: ignore[attr-defined]
    assert response.choices[0].text.startswith(detokenize(server, kept))  # echo shows what was kept
    chat = client.chat.completions.create(
        model=server.model_name, messages=CONVERSATION, max_tokens=1, extra_body=extra
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 5
    assert chat.prompt_token_ids == tokenize(server, messages=CONVERSATION)[keep]  # type: ignore[attr-defined]


def test_allowed_token_ids_restrict_sampling(client: openai.OpenAI, server: ServerProcess) -> None:
    allowed = tokenize(server, prompt=" Paris London Rome")
    extra = {"allowed_token_ids": allowed, "return_token_ids": True}
    response = client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=6, temperature=1.0, n=2, seed=0, extra_body=extra
    )
    sampled = [t for choice in response.choices for t in choice.token_ids]  # type: ignore[attr-defined]
    assert len(sampled) == 12 and set(sampled) <= set(allowed)
    chat = client.chat.completions.create(
        model=server.model_name, messages=CONVERSATION, max_tokens=4, temperature=1.0, extra_body=extra
    )
    assert set(chat.choices[0].token_ids) <= set(allowed)  # type: ignore[attr-defined]
    error = bad_request(
        lambda: client.completions.create(
            model=server.model_name, prompt=PROMPT, extra_body={"allowed_token_ids": [1, 49152]}
        )
    )
    assert error["param"] == "allowed_token_ids" and "vocabulary" in error["message"]


# ---- chat: roles, echo, continue_final_message, template variables ---------------------------------


def test_custom_roles_go_to_the_template(client: openai.OpenAI, server: ServerProcess) -> None:
    messages = [{"role": "narrator", "content": "Once upon a time"}, *CONVERSATION]
    response = client.chat.completions.create(
        model=server.model_name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        extra_body={"return_token_ids": True},
    )
    prompt = detokenize(server, response.prompt_token_ids)  # type: ignore[attr-defined]
    assert "<|im_start|>narrator\nOnce upon a time<|im_end|>" in prompt


def test_continue_final_message_with_echo(client: openai.OpenAI, server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Tell me a saying."}, {"role": "assistant", "content": SAYING}]

    def chat(stream: bool = False, **extra: Any) -> Any:
        return client.chat.completions.create(
            model=server.model_name,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=3,
            temperature=0,
            stream=stream,
            extra_body={"return_token_ids": True, **extra},
        )

    echoed = chat(continue_final_message=True, add_generation_prompt=False, echo=True)
    prompt = detokenize(server, echoed.prompt_token_ids)
    assert prompt.endswith(f"<|im_start|>assistant\n{SAYING}")  # left open: no <|im_end|>
    message = echoed.choices[0].message
    assert message.role == "assistant" and message.content.startswith(SAYING)
    # continue_final_message alone implies add_generation_prompt false.
    plain = chat(continue_final_message=True)
    assert plain.prompt_token_ids == echoed.prompt_token_ids
    assert SAYING + plain.choices[0].message.content == message.content
    chunks = list(chat(stream=True, continue_final_message=True, echo=True))
    assert chunks[0].choices[0].delta.content == SAYING
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    error = bad_request(lambda: chat(continue_final_message=True, add_generation_prompt=True))
    assert error["param"] == "continue_final_message"


def test_add_generation_prompt_false(client: openai.OpenAI, server: ServerProcess) -> None:
    response = client.chat.completions.create(
        model=server.model_name,
        messages=CONVERSATION,  # type: ignore[arg-type]
        max_tokens=1,
        extra_body={"add_generation_prompt": False, "return_token_ids": True, "echo": True},
    )
    without = tokenize(server, messages=CONVERSATION, add_generation_prompt=False)
    assert response.prompt_token_ids == without != tokenize(server, messages=CONVERSATION)  # type: ignore[attr-defined]
    # The answer continues the last message, a user's: its role, and with echo its text first.
    message = response.choices[0].message
    assert message.role == "user" and (message.content or "").startswith(CONVERSATION[0]["content"])


def test_documents_and_reasoning_effort_reach_the_template(client: openai.OpenAI, server: ServerProcess) -> None:
    template = (
        "{% for d in documents %}[{{ d.title }}]{% endfor %}effort={{ reasoning_effort }};"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    response = client.chat.completions.create(
        model=server.model_name,
        messages=CONVERSATION,  # type: ignore[arg-type]
        max_tokens=1,
        reasoning_effort="low",
        extra_body={
            "chat_template": template,
            "documents": [{"title": "Atlas", "text": "Paris is in France."}],
            "return_token_ids": True,
        },
    )
    assert detokenize(server, response.prompt_token_ids).startswith("[Atlas]effort=low;")  # type: ignore[attr-defined]


def test_request_id_names_the_response(client: openai.OpenAI, server: ServerProcess) -> None:
    response = client.chat.completions.create(
        model=server.model_name, messages=CONVERSATION, max_tokens=1, extra_body={"request_id": "client-42"}
    )
    assert response.id == "chatcmpl-client-42"
    completion = client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=1, extra_body={"request_id": "client-43"}
    )
    assert completion.id == "cmpl-client-43"


# ---- what shoal refuses -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "field", "value"),
    [
        ("completions", "suffix", "!"),
        ("completions", "bad_words", ["Paris"]),
        ("completions", "priority", 1),
        ("completions", "cache_salt", "salt"),
        ("completions", "vllm_xargs", {"a": 1}),
        ("chat", "logits_processors", ["my.Processor"]),
        ("chat", "functions", [{"name": "f"}]),
        ("chat", "structural_tag", "{}"),
    ],
)
def test_unsupported_vllm_fields_are_refused_by_name(
    client: openai.OpenAI, server: ServerProcess, route: str, field: str, value: Any
) -> None:
    def call() -> Any:
        if route == "completions":
            return client.completions.create(model=server.model_name, prompt=PROMPT, extra_body={field: value})
        return client.chat.completions.create(model=server.model_name, messages=CONVERSATION, extra_body={field: value})

    error = bad_request(call)
    assert error["param"] == field and field in error["message"] and "not supported" in error["message"]


def test_unsupported_fields_that_ask_for_nothing_are_served(client: openai.OpenAI, server: ServerProcess) -> None:
    nothing = {"best_of": 1, "bad_words": [], "priority": 0, "logits_processors": None, "vllm_xargs": {}}
    assert client.completions.create(model=server.model_name, prompt=PROMPT, max_tokens=1, extra_body=nothing).choices
