"""Incremental detokenization and stop strings, on the demo model's real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.frontend.detokenizer import IncrementalDetokenizer
from shoal.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! This is shoal.",
    "héllo wörld — naïve café, 你好世界, emoji 🙂🚀 and ünïcödé.",
    "  leading spaces\n\ttabs and\nnewlines  ",
    "def f(x):\n    return x ** 2  # squares",
]


class SlowTokenizer:
    """The demo tokenizer seen through the slow-tokenizer interface only (no `_tokenizer`)."""

    def __init__(self, fast: Any) -> None:
        self._fast = fast

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tokenizer: Any, prompt: list[int], output: list[int], params: SamplingParams) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    for token_id in output:
        if detok.update([token_id], stop_terminated=False) is not None:
            break
    return detok


@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_batch_decode(demo_tokenizer: Any, text: str, slow: bool) -> None:
    prompt = demo_tokenizer.encode("Say something:")
    output = demo_tokenizer.encode(text)
    tokenizer = SlowTokenizer(demo_tokenizer) if slow else demo_tokenizer
    detok = stream(tokenizer, prompt, output, SamplingParams())
    assert detok.output_text == demo_tokenizer.decode(output, skip_special_tokens=True)


def test_multibyte_characters_split_across_tokens_are_never_emitted_half(demo_tokenizer: Any) -> None:
    output = demo_tokenizer.encode("你好 🙂")
    detok = IncrementalDetokenizer(demo_tokenizer, [1], SamplingParams())
    pieces = []
    for token_id in output:
        detok.update([token_id], stop_terminated=False)
        pieces.append(detok.text_delta(finished=False))
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == "你好 🙂"
    assert len(output) > len("你好 🙂")  # the characters really span several tokens


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_text(demo_tokenizer: Any, include: bool) -> None:
    output = demo_tokenizer.encode("The answer is 42. STOP here and more text")
    params = SamplingParams(stop=["STOP", "never"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(demo_tokenizer, [1], params)
    num_fed, hit = 0, None
    while hit is None and num_fed < len(output):
        hit = detok.update([output[num_fed]], stop_terminated=False)
        num_fed += 1
    assert hit == "STOP"
    assert num_fed < len(output)  # stopped early, not at the end
    assert detok.output_text == ("The answer is 42. STOP" if include else "The answer is 42. ")


def test_stream_holds_back_a_possible_stop_string(demo_tokenizer: Any) -> None:
    output = demo_tokenizer.encode("one two three")
    detok = IncrementalDetokenizer(demo_tokenizer, [1], SamplingParams(stop=["three four"]))
    streamed = ""
    for token_id in output:
        assert detok.update([token_id], stop_terminated=False) is None
        streamed += detok.text_delta(finished=False)
    # "three" might still grow into "three four": it stays held back until the end.
    assert "three" not in streamed
    streamed += detok.text_delta(finished=True)
    assert streamed == "one two three"


def test_stop_token_text_is_left_out_unless_asked(demo_tokenizer: Any) -> None:
    words = demo_tokenizer.encode("alpha beta")
    for include, expected in [(False, "alpha"), (True, "alpha beta")]:
        detok = IncrementalDetokenizer(demo_tokenizer, [1], SamplingParams(include_stop_str_in_output=include))
        detok.update(words, stop_terminated=True)
        assert detok.output_text == expected


@pytest.fixture(scope="module")
def sentencepiece_tokenizer(tmp_path_factory) -> Any:
    """Mistral-7B's SentencePiece tokenizer (Llama-2 style, '▁' spacing, byte fallback), read
    from the mistral-common wheel that `make test` downloads into .venv/test-data."""
    import json
    import sys
    import zipfile
    from pathlib import Path

    from transformers import AutoTokenizer

    wheels = sorted(Path(sys.prefix, "test-data").glob("mistral_common-*.whl"))
    assert wheels, "run `make install-test` (it downloads the mistral-common wheel into .venv/test-data)"
    folder = tmp_path_factory.mktemp("spm")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        (folder / "tokenizer.model").write_bytes(wheel.read("mistral_common/data/tokenizer.model.v1"))
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_continuation_spacing(sentencepiece_tokenizer: Any, text: str, slow: bool) -> None:
    """A continuation keeps the space that SentencePiece marks with '▁' on its first token:
    the streamed text is exactly what decoding prompt + output adds to the prompt's text."""
    tokenizer = sentencepiece_tokenizer
    prompt = tokenizer.encode("Say something:")
    output = tokenizer.encode(" " + text, add_special_tokens=False)
    whole = tokenizer.decode(prompt + output, skip_special_tokens=True)
    expected = whole[len(tokenizer.decode(prompt, skip_special_tokens=True)) :]
    detok = stream(SlowTokenizer(tokenizer) if slow else tokenizer, prompt, output, SamplingParams())
    assert detok.output_text == expected


@pytest.mark.parametrize("slow", [False, True])
def test_an_output_cut_inside_a_character_drops_its_bytes(demo_tokenizer: Any, slow: bool) -> None:
    """`max_tokens` can end an output between the tokens of one character: its first bytes
    were held back from the stream, and the final text leaves them out the same way."""
    ids = demo_tokenizer.encode("ok 你好, 世界 and ünïcödé")
    # The lengths that end inside a character (a whole decode writes its bytes as U+FFFD).
    cuts = [n for n in range(1, len(ids)) if demo_tokenizer.decode(ids[:n]).endswith("\ufffd")]
    assert len(cuts) >= 3
    tokenizer = SlowTokenizer(demo_tokenizer) if slow else demo_tokenizer
    for n in cuts:
        whole_chars = demo_tokenizer.decode(ids[:n]).rstrip("\ufffd")
        detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
        streamed = ""
        for token_id in ids[: n - 1]:
            detok.update([token_id], stop_terminated=False)
            streamed += detok.text_delta(finished=False)
        detok.update(ids[n - 1 : n], stop_terminated=False, finished=True)
        streamed += detok.text_delta(finished=True)
        assert detok.output_text == streamed == whole_chars, (n, detok.output_text)
