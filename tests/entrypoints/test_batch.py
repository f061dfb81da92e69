"""`shoal batch` on one engine: the OpenAI batch format in and out, the server's answers (the same
greedy text as `LLM.generate`, the same 4xx bodies), bad lines as error lines, and a resumed run
that writes every missing line once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal import LLM, SamplingParams
from shoal.cli import main as shoal_main
from shoal.entrypoints.batch_format import read_input

PROMPTS = ["The quick brown fox", "Hello world", "One two three", "Ray clusters are"]
MAX_TOKENS = 5


def _requests(model: str) -> list[str]:
    lines = []
    for i, prompt in enumerate(PROMPTS):
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        lines.append(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS, "temperature": 0.0}
    lines.append(json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat}))
    lines.append("{not json")
    bad_type = {"prompt": "x", "max_tokens": "5"}
    lines.append(json.dumps({"custom_id": "bad-type", "method": "POST", "url": "/v1/completions", "body": bad_type}))
    lines.append(json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}))
    lines.append(
        json.dumps({"custom_id": "bad-model", "url": "/v1/completions", "body": {"prompt": "x", "model": "m"}})
    )
    return lines


def _read(path: Path) -> dict[str, dict]:
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    by_id = {line["custom_id"] or line["id"]: line for line in lines}
    assert len(by_id) == len(lines), "a request was answered twice"
    return by_id


def test_batch_answers_like_the_server_and_resumes(tiny_checkpoints: dict, tmp_path: Path) -> None:
    model = str(tiny_checkpoints["llama"])
    requests, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text("\n".join(_requests(model)) + "\n")
    argv = ["batch", "-i", str(requests), "-o", str(output), "--model", model, "--disable-progress-bar"]
    assert shoal_main(argv) == 0
    results = _read(output)
    assert len(results) == 9

    llm = LLM(model, multiprocess=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.shutdown()
    for i, text in enumerate(expected):
        response = results[f"c{i}"]["response"]
        assert response["status_code"] == 200 and results[f"c{i}"]["error"] is None
        assert response["body"]["object"] == "text_completion" and response["request_id"] == response["body"]["id"]
        assert response["body"]["choices"][0]["text"] == text
    assert results["chat"]["response"]["body"]["choices"][0]["message"]["role"] == "assistant"

    # Bad lines: a request the server refuses keeps its 4xx body; a line that is no request is an error.
    bad_type = results["bad-type"]["response"]
    assert bad_type["status_code"] == 400 and bad_type["body"]["error"]["param"] == "max_tokens"
    assert results["bad-model"]["response"]["status_code"] == 404
    assert results["bad-url"]["response"] is None and "url must be one of" in results["bad-url"]["error"]["message"]
    not_json = results["batch_req_line_6"]
    assert not_json["custom_id"] is None and "line 6 is not valid JSON" in not_json["error"]["message"]

    # A killed run: three whole lines and half of the fourth. The rerun writes each missing line once.
    kept = output.read_text().splitlines()[:4]
    output.write_text("\n".join(kept[:3]) + "\n" + kept[3][: len(kept[3]) // 2])
    assert shoal_main(argv) == 0
    resumed = _read(output)
    assert set(resumed) == set(results)
    assert output.read_text().splitlines()[:3] == kept[:3]  # the finished lines were not redone
    for i, text in enumerate(expected):
        assert resumed[f"c{i}"]["response"]["body"]["choices"][0]["text"] == text
    assert shoal_main(argv) == 0 and output.read_text().count("\n") == 9  # nothing left to do


def test_duplicate_custom_ids_are_refused(tmp_path: Path) -> None:
    line = json.dumps({"custom_id": "same", "url": "/v1/completions", "body": {"prompt": "x"}})
    requests = tmp_path / "requests.jsonl"
    requests.write_text(f"{line}\n\n{line}\n")
    with pytest.raises(ValueError, match="custom_id 'same' appears on lines 1 and 3"):
        read_input(requests)


def test_a_reply_cut_inside_a_character_has_no_replacement_char(tiny_checkpoints: dict, tmp_path: Path) -> None:
    """The tiny tokenizer is byte-level: "你" is three byte tokens. A reply forced to the first
    of them and cut there by max_tokens leaves that byte out, as the stream would."""
    from transformers import AutoTokenizer

    model = str(tiny_checkpoints["llama"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    first_byte = tokenizer.convert_tokens_to_ids(
        "你".encode()[:1].decode("latin-1")
    )  # byte 0xE4 is "ä" in the alphabet
    assert tokenizer.decode([first_byte]) == "\ufffd"
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "logit_bias": {str(first_byte): 100}}
    line = {"custom_id": "cut", "method": "POST", "url": "/v1/completions", "body": body}
    requests, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text(json.dumps(line) + "\n")
    argv = ["batch", "-i", str(requests), "-o", str(output), "--model", model, "--disable-progress-bar"]
    assert shoal_main(argv) == 0
    choice = _read(output)["cut"]["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == ""
