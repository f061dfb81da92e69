"""SamplingParams: validation names the bad field; values survive msgpack and json."""

from __future__ import annotations

import math

import msgspec
import pytest

from shoal.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams, offset_seed


def test_defaults() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.max_tokens, params.min_tokens, params.stop, params.stop_token_ids) == (16, 0, [], [])
    assert params.logprobs is None and params.prompt_logprobs is None and params.seed is None
    assert not params.ignore_eos and not params.greedy


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0.0, True), (0, True), (1e-6, True), (1e-5, False), (0.5, False), (2.0, False)]
)
def test_greedy_below_a_tiny_temperature(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_normalization() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="END").stop == ["END"]  # type: ignore[arg-type]
    assert SamplingParams(top_k=5).top_k == 5


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("n", {"n": 0}),
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": math.nan}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.01}),
        ("top_k", {"top_k": -2}),
        ("min_p", {"min_p": -0.01}),
        ("min_p", {"min_p": 1.5}),
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("frequency_penalty", {"frequency_penalty": -2.01}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("max_tokens", {"max_tokens": 0}),
        ("min_tokens", {"min_tokens": -1}),
        ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
        ("logprobs", {"logprobs": -1}),
        ("logprobs", {"logprobs": MAX_LOGPROBS + 1}),
        ("prompt_logprobs", {"prompt_logprobs": MAX_LOGPROBS + 1}),
        ("stop", {"stop": ["ok", ""]}),
        ("stop_token_ids", {"stop_token_ids": [3, -1]}),
        ("seed", {"seed": -(2**63) - 1}),
        ("seed", {"seed": 2**63}),
        ("allowed_token_ids", {"allowed_token_ids": []}),
        ("allowed_token_ids", {"allowed_token_ids": [3, -1]}),
        (
            "allowed_token_ids",
            {"allowed_token_ids": [3], "structured_outputs": StructuredOutputsParams(choice=["a"])},
        ),
    ],
)
def test_invalid_value_raises_naming_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field} "):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"max_tokens": None, "min_tokens": 1000},
        {"max_tokens": 4, "min_tokens": 4},
        {"logprobs": 0, "prompt_logprobs": MAX_LOGPROBS},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"seed": -1},
        {"seed": -(2**63)},
        {"allowed_token_ids": [0, 7]},
        {"stop_token_ids": [0]},
    ],
)
def test_edge_values_are_accepted(kwargs: dict[str, object]) -> None:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    for name, value in kwargs.items():
        assert getattr(params, name) == value


@pytest.mark.parametrize(
    ("seed", "offset", "expected"),
    [(5, 2, 7), (-1, 1, 0), (2**63 - 1, 1, -(2**63)), (2**63 - 2, 3, -(2**63) + 1), (-(2**63), 0, -(2**63))],
)
def test_offset_seed_wraps_around_the_signed_range(seed: int, offset: int, expected: int) -> None:
    assert offset_seed(seed, offset) == expected
    SamplingParams(seed=offset_seed(seed, offset))  # still a valid seed


def test_clone_changes_fields_and_validates_again() -> None:
    params = SamplingParams(temperature=0.5, stop=["x"])
    clone = params.clone(temperature=0.0, max_tokens=3)
    assert (clone.temperature, clone.max_tokens, clone.stop) == (0.0, 3, ["x"])
    assert (params.temperature, params.max_tokens) == (0.5, 16)
    with pytest.raises(ValueError, match=r"SamplingParams\.n "):
        params.clone(n=0)


def test_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]


FULL = SamplingParams(
    n=2,
    temperature=0.8,
    top_p=0.95,
    top_k=50,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.1,
    seed=42,
    max_tokens=100,
    min_tokens=10,
    stop=["</s>", "\n"],
    stop_token_ids=[2, 13],
    ignore_eos=True,
    logprobs=5,
    prompt_logprobs=1,
    include_stop_str_in_output=True,
    skip_special_tokens=False,
    spaces_between_special_tokens=False,
    detokenize=False,
    allowed_token_ids=[2, 13, 40],
)


@pytest.mark.parametrize(
    "params", [SamplingParams(), FULL, SamplingParams(max_tokens=None)], ids=["default", "full", "no-max"]
)
@pytest.mark.parametrize("codec", [msgspec.msgpack, msgspec.json])
def test_roundtrip(params: SamplingParams, codec) -> None:
    decoded = codec.decode(codec.encode(params), type=SamplingParams)
    assert decoded == params
    assert msgspec.structs.asdict(decoded) == msgspec.structs.asdict(params)


def test_defaults_are_not_sent() -> None:
    assert msgspec.json.encode(SamplingParams()) == b"{}"
    assert msgspec.json.decode(msgspec.json.encode(SamplingParams(top_k=3))) == {"top_k": 3}
    # None is sent when it differs from the default: an unlimited max_tokens must not become 16.
    assert msgspec.json.decode(b'{"max_tokens":null}', type=SamplingParams).max_tokens is None


@pytest.mark.parametrize(
    ("payload", "field"),
    [(b'{"n":0}', "n"), (b'{"top_p":2.0}', "top_p"), (b'{"min_tokens":9,"max_tokens":3}', "min_tokens")],
)
def test_decoding_invalid_values_fails_naming_the_field(payload: bytes, field: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=rf"SamplingParams\.{field} "):
        msgspec.json.decode(payload, type=SamplingParams)


def test_decoding_wrong_types_fails() -> None:
    with pytest.raises(msgspec.ValidationError, match="stop_token_ids"):
        msgspec.json.decode(b'{"stop_token_ids":["a"]}', type=SamplingParams)
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.json.decode(b'{"temperature":"hot"}', type=SamplingParams)
