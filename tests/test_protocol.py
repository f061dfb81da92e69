"""Every struct that crosses a process boundary survives msgpack with its exact value."""

from __future__ import annotations

import inspect

import msgspec
import pytest

import shoal.protocol as protocol
import shoal.step as step
from shoal.protocol import (
    Abort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    MessageType,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
    decode,
    encode,
)
from shoal.sampling_params import SamplingParams, StructuredOutputsParams
from shoal.step import (
    CachedRequestData,
    GrammarBitmask,
    KVBlockCopies,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    RoutedExperts,
    SchedulerOutput,
)

PARAMS = SamplingParams(
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    seed=1234,
    max_tokens=32,
    min_tokens=2,
    stop=["\n\n", "END"],
    stop_token_ids=[7, 8],
    logprobs=3,
)
LOGPROBS = LogprobsLists(
    token_ids=[[5, 1, 2], [9, 9, 4]],
    logprobs=[[-0.25, -1.5, -2.75], [-0.125, -0.125, -3.0]],
    ranks=[1, 2],
)
NEW_REQUEST = NewRequestData(
    req_id="req-1",
    prompt_token_ids=[1, 2, 3, 4, 5],
    output_token_ids=[6, 7],
    sampling_params=PARAMS,
    block_ids=[3, 0, 8],
    num_computed_tokens=4,
    eos_token_id=2,
    lora_name="sql-adapter",
)
CACHED_REQUEST = CachedRequestData(req_id="req-2", new_token_ids=[42], new_block_ids=[11], num_computed_tokens=17)
SCHEDULER_STATS = SchedulerStats(
    num_running_reqs=3,
    num_waiting_reqs=1,
    kv_cache_usage=0.375,
    num_used_blocks=12,
    prefix_cache_queries=100,
    prefix_cache_hits=48,
    num_preemptions=2,
    num_prompt_tokens=30,
    num_generation_tokens=3,
    num_deferred_reqs=1,
)
ENGINE_CORE_OUTPUT = EngineCoreOutput(
    request_id="req-1",
    new_token_ids=[5, 9],
    new_logprobs=LOGPROBS,
    new_prompt_logprobs=LOGPROBS.slice(0, 1),
    finish_reason="stop",
    stop_reason=8,
    num_cached_tokens=16,
    first_scheduled_time=1712345678.75,
)

# One example per struct type, every field away from its default.
EXAMPLES: list[msgspec.Struct] = [
    PARAMS,
    EngineCoreRequest(
        request_id="req-1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=PARAMS,
        eos_token_id=2,
        arrival_time=1712345678.25,
        max_tokens=32,
        lora_name="sql-adapter",
    ),
    EngineCoreRequest(
        request_id="req-none",
        prompt_token_ids=[1],
        sampling_params=SamplingParams(),
        eos_token_id=None,
        arrival_time=0.5,
        max_tokens=1,
    ),
    ENGINE_CORE_OUTPUT,
    EngineCoreOutput(request_id="req-3", new_token_ids=[1], finish_reason="stop", stop_reason="</s>"),
    EngineCoreOutput(request_id="req-4", new_token_ids=[]),
    SCHEDULER_STATS,
    EngineCoreOutputs(
        outputs=[ENGINE_CORE_OUTPUT, EngineCoreOutput(request_id="req-5", new_token_ids=[3])],
        scheduler_stats=SCHEDULER_STATS,
        timestamp=1712345678.5,
        weight_version="step-12",
    ),
    EngineCoreOutputs(),
    NEW_REQUEST,
    CACHED_REQUEST,
    SchedulerOutput(
        new_reqs=[NEW_REQUEST],
        cached_reqs=[CACHED_REQUEST],
        num_scheduled_tokens={"req-2": 3, "req-1": 3},
        total_num_scheduled_tokens=6,
        finished_req_ids=["req-0"],
        step_id=9,
        scheduled_spec_decode_tokens={"req-2": [17, 4]},
    ),
    SchedulerOutput(
        new_reqs=[],
        cached_reqs=[CACHED_REQUEST],
        num_scheduled_tokens={"req-2": 1},
        total_num_scheduled_tokens=1,
        structured_req_ids=["req-2"],
        grammar=GrammarBitmask(req_ids=["req-2"], bitmask=b"\xff\x00\x00\x80" * 3, num_words=3),
    ),
    SchedulerOutput(
        new_reqs=[],
        cached_reqs=[CACHED_REQUEST],
        num_scheduled_tokens={"req-2": 1},
        total_num_scheduled_tokens=1,
        structured_req_ids=["req-2"],
        grammar_follows=True,
    ),
    GrammarBitmask(req_ids=["a", "b"], bitmask=bytes(range(16)), num_words=2),
    SamplingParams(logit_bias={3: -100.0, 17: 2.5}),
    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}, reasoning_end_token_ids=[5])),
    SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"], disable_any_whitespace=False)),
    StructuredOutputsParams(regex="[a-z]+"),
    LOGPROBS,
    ModelRunnerOutput(
        req_ids=["req-2", "req-1"],
        sampled_token_ids=[[42], []],
        logprobs={"req-2": LOGPROBS.slice(0, 1)},
        prompt_logprobs={"req-1": LOGPROBS},
        step_id=9,
        routed_experts={
            "req-2": RoutedExperts(start=3, num_layers=2, top_k=1, expert_ids=b"\x01\0\0\0\xff\xff\xff\xff")
        },
    ),
    EngineCoreOutput(
        request_id="req-6",
        new_token_ids=[5],
        new_routed_experts=RoutedExperts(start=0, num_layers=1, top_k=2, expert_ids=bytes(range(8))),
    ),
    RoutedExperts(start=7, num_layers=3, top_k=1, expert_ids=bytes(12)),
    Abort(request_ids=["req-1", "req-2"]),
    UtilityRequest(call_id=3, method="collective_rpc", args=["report_device", [], None, 5.0]),
    UtilityOutput(call_id=3, result=[{"rank": 0}, "cpu"], error=None),
    UtilityOutput(call_id=4, error="ValueError: no such method"),
    EngineReady(num_kv_blocks=1456),
    EngineDead(message="worker 1 died"),
    SchedulerOutput(
        new_reqs=[],
        cached_reqs=[CACHED_REQUEST],
        num_scheduled_tokens={"req-2": 1},
        total_num_scheduled_tokens=1,
        kv_block_copies=KVBlockCopies(
            offload_block_ids=[4, 9], offload_host_ids=[0, 1], load_host_ids=[1], load_block_ids=[4]
        ),
    ),
    KVBlockCopies(load_host_ids=[3], load_block_ids=[7]),
]


def _roundtrip(value: msgspec.Struct) -> msgspec.Struct:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=type(value))


@pytest.mark.parametrize("value", EXAMPLES, ids=lambda v: type(v).__name__)
def test_msgpack_roundtrip_is_exact(value: msgspec.Struct) -> None:
    decoded = _roundtrip(value)
    assert type(decoded) is type(value)
    assert decoded == value
    assert msgspec.structs.asdict(decoded) == msgspec.structs.asdict(value)


def test_every_wire_struct_has_a_roundtrip_example() -> None:
    structs = {
        obj
        for module in (protocol, step)
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, msgspec.Struct) and obj.__module__ == module.__name__
    }
    assert structs <= {type(value) for value in EXAMPLES}


def test_roundtrip_keeps_the_union_member_of_stop_reason() -> None:
    as_int = _roundtrip(EngineCoreOutput(request_id="a", new_token_ids=[], stop_reason=7))
    as_str = _roundtrip(EngineCoreOutput(request_id="a", new_token_ids=[], stop_reason="7"))
    assert as_int.stop_reason == 7 and isinstance(as_int.stop_reason, int)
    assert as_str.stop_reason == "7" and isinstance(as_str.stop_reason, str)


def test_roundtrip_differs_when_a_field_differs() -> None:
    changed = msgspec.structs.replace(CACHED_REQUEST, new_token_ids=[43])
    assert _roundtrip(changed) != CACHED_REQUEST


def test_defaults_are_omitted_and_restored() -> None:
    small = EngineCoreOutput(request_id="a", new_token_ids=[1])
    full = EngineCoreOutput(request_id="a", new_token_ids=[1], finish_reason="length", num_cached_tokens=4)
    assert len(msgspec.msgpack.encode(small)) < len(msgspec.msgpack.encode(full))
    decoded = _roundtrip(small)
    assert (decoded.new_logprobs, decoded.finish_reason, decoded.stop_reason, decoded.num_cached_tokens) == (
        None,
        None,
        None,
        0,
    )
    assert not decoded.finished and _roundtrip(full).finished


def test_decoding_the_wrong_shape_fails_loudly() -> None:
    data = msgspec.msgpack.encode(CACHED_REQUEST)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(data, type=NewRequestData)
    bad = msgspec.msgpack.encode(["req", ["not-an-int"], [], 0])
    with pytest.raises(msgspec.ValidationError, match="int"):
        msgspec.msgpack.decode(bad, type=CachedRequestData)


def test_invalid_sampling_params_are_rejected_on_decode() -> None:
    request = msgspec.structs.replace(EXAMPLES[1], sampling_params=PARAMS)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(request))
    raw[2]["top_p"] = 0.0  # EngineCoreRequest is array-like; field 2 is sampling_params
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=EngineCoreRequest)


def test_logprobs_slice_and_scheduled_req_ids() -> None:
    assert LOGPROBS.slice(1, 2) == LogprobsLists(token_ids=[[9, 9, 4]], logprobs=[[-0.125, -0.125, -3.0]], ranks=[2])
    assert LOGPROBS.slice(0, 0) == LogprobsLists(token_ids=[], logprobs=[], ranks=[])
    assert EXAMPLES[11].scheduled_req_ids == ["req-2", "req-1"]
    assert _roundtrip(EXAMPLES[11]).scheduled_req_ids == ["req-2", "req-1"]


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        (MessageType.ADD, EXAMPLES[1]),
        (MessageType.ABORT, Abort(request_ids=["a"])),
        (MessageType.UTILITY, UtilityRequest(call_id=1, method="get_stats", args=[])),
        (MessageType.OUTPUTS, EXAMPLES[7]),
        (MessageType.UTILITY_OUTPUT, UtilityOutput(call_id=1, result={"x": 1})),
        (MessageType.READY, EngineReady(num_kv_blocks=7)),
        (MessageType.ENGINE_DEAD, EngineDead(message="gone")),
    ],
)
def test_framed_messages_roundtrip(kind: MessageType, value: msgspec.Struct) -> None:
    frames = encode(kind, value)
    assert frames[0] == kind.value and len(frames[0]) == 1
    assert decode(frames) == (kind, value)


def test_framing_refuses_a_struct_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="ABORT"):
        encode(MessageType.ABORT, EngineDead(message="x"))
    with pytest.raises(ValueError):
        decode([b"\x7f", b""])


STEP_EXAMPLES = [value for value in EXAMPLES if type(value).__module__ == step.__name__]


@pytest.mark.parametrize("value", STEP_EXAMPLES, ids=lambda v: type(v).__name__)
def test_a_step_cannot_be_changed_once_built(value: msgspec.Struct) -> None:
    """What the scheduler built is what the workers get: every field of every step struct is
    read-only (a step's bitmask travels in it or follows it, decided as it is built)."""
    for name in value.__struct_fields__:
        with pytest.raises(AttributeError):
            setattr(value, name, getattr(value, name))


def test_every_step_struct_is_frozen() -> None:
    structs = {type(value) for value in STEP_EXAMPLES}
    assert {GrammarBitmask, SchedulerOutput, NewRequestData, CachedRequestData, ModelRunnerOutput} <= structs
    assert all(struct.__struct_config__.frozen for struct in structs)
