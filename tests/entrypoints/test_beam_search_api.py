"""Beam search through the session's demo-model server (vLLM's `use_beam_search`,
`length_penalty`, `best_of`), through the official `openai` client: `n` choices ordered by
score, streamed the same, and the fields it cannot honour refused with a 400 naming them."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.entrypoints.server_utils import ServerProcess

PROMPT = "The best thing about Paris is"
MAX_TOKENS = 6


def _score(token_logprobs: list[float], length_penalty: float) -> float:
    return sum(token_logprobs) / len(token_logprobs) ** length_penalty


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_completions_return_n_beams_ordered_by_score(
    client: openai.OpenAI, server: ServerProcess, length_penalty: float
) -> None:
    beams = {"use_beam_search": True, "length_penalty": length_penalty}
    completion = client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, n=3, logprobs=1, extra_body=beams
    )
    assert [c.index for c in completion.choices] == [0, 1, 2]
    texts = [c.text for c in completion.choices]
    assert len(set(texts)) == 3  # three different beams
    scores = [_score(c.logprobs.token_logprobs, length_penalty) for c in completion.choices]
    assert scores == sorted(scores, reverse=True)
    assert all(len(top) <= 2 for c in completion.choices for top in c.logprobs.top_logprobs)  # chosen + top 1
    # The best beam scores at least as well as greedy decoding's answer.
    greedy = client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=1
    ).choices[0]
    assert scores[0] >= _score(greedy.logprobs.token_logprobs, length_penalty) - 1e-4
    # best_of beams searched, n returned; and the same beams streamed.
    wider = client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, n=2, extra_body={**beams, "best_of": 4}
    )
    assert len(wider.choices) == 2
    stream = client.completions.create(
        model=server.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, n=3, stream=True, extra_body=beams
    )
    streamed = {chunk.choices[0].index: chunk.choices[0].text for chunk in stream if chunk.choices}
    assert [streamed[i] for i in range(3)] == texts


def test_chat_returns_n_beams_ordered_by_score(client: openai.OpenAI, server: ServerProcess) -> None:
    chat = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=MAX_TOKENS,
        n=2,
        logprobs=True,
        extra_body={"use_beam_search": True},
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content != chat.choices[1].message.content
    scores = [_score([t.logprob for t in c.logprobs.content], 1.0) for c in chat.choices]
    assert scores[0] >= scores[1]
    assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"use_beam_search": True, "stop": ["."]}, "stop"),
        ({"use_beam_search": True, "logit_bias": {"5": 1}}, "logit_bias"),
        ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
        ({"use_beam_search": True, "guided_choice": ["a", "b"]}, "structured output"),
        ({"use_beam_search": True, "n": 3, "best_of": 2}, "best_of must be at least n"),
        ({"use_beam_search": True, "n": 11}, "at most 10 beams"),
        ({"use_beam_search": True, "max_tokens": 0}, "max_tokens"),
        ({"best_of": 2}, "needs use_beam_search"),
        ({"length_penalty": 2.0}, "needs use_beam_search"),
    ],
)
def test_what_beam_search_cannot_honour_is_a_400(server: ServerProcess, body: dict, named: str) -> None:
    request = {"prompt": PROMPT, "max_tokens": 4, **body}
    response = httpx.post(f"{server.url}/v1/completions", json=request, timeout=60)
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]


def test_a_client_gone_mid_search_aborts_its_beams(server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "max_tokens": 300, "n": 4, "use_beam_search": True, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=3))
    server.wait_for_metric("shoal:num_requests_running", 0, timeout_s=60)
    generated = server.metric("shoal:generation_tokens_total")
    time.sleep(1.5)  # (a search still going would start its next round meanwhile)
    assert server.metric("shoal:generation_tokens_total") == generated
    assert httpx.get(f"{server.url}/load", timeout=30).json()["server_load"] == 0
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
