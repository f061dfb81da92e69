"""Every message that crosses the frontend ↔ engine-core boundary, as msgspec structs.

The frontend sends `EngineCoreRequest` (already tokenized and validated), aborts and utility
calls; the core answers with `EngineCoreOutputs` (per request the new token ids, logprobs and
finish reason; per step the scheduler's statistics), utility results, a ready message once it
has started and an engine-dead message when it fails.

On the ZeroMQ sockets a message is two frames: a one-byte `MessageType`, then the msgpack
encoding of the struct that type names (`encode` / `decode`). No pickle.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from shoal.sampling_params import SamplingParams
from shoal.step import LogprobsLists, RoutedExperts


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    # The most tokens this request may generate (already capped by max_model_len).
    max_tokens: int
    # The LoRA adapter to run the request with (None: the base model), one the engine has loaded
    # (`add_lora`); carried to the workers (`NewRequestData.lora_name`).
    lora_name: str | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # When the request was first scheduled (set on its finishing output, for queue-time stats).
    first_scheduled_time: float | None = None
    # The experts of the positions computed since the last output (`return_routed_experts`).
    new_routed_experts: RoutedExperts | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0  # in the waiting queue: held for room in the batch (or a pause)
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens
    num_preemptions: int = 0  # cumulative
    num_prompt_tokens: int = 0  # computed this step
    num_generation_tokens: int = 0  # sampled this step
    # Kept out of the waiting queue until something other than room is ready: in shoal, a
    # structured-output request whose grammar is being compiled, or a request parked while its
    # KV is loaded from a prefill engine.
    num_deferred_reqs: int = 0
    # LoRA (vLLM's lora_requests_info): the adapters of the running and the waiting requests.
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)
    max_loras: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # The weight version of the step whose tokens these are (None: no step's, e.g. the final
    # outputs of requests a pause aborted).
    weight_version: str | None = None


class Abort(msgspec.Struct, array_like=True):
    request_ids: list[str]


class UtilityRequest(msgspec.Struct, array_like=True):
    """Call `EngineCore.<method>(*args)` in the engine loop (collective_rpc, get_stats, ...).
    Arguments and results must be msgpack data: numbers, strings, lists, dicts."""

    call_id: int
    method: str
    args: list[Any]


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None  # the exception's type and message when the call failed


class EngineReady(msgspec.Struct, array_like=True):
    num_kv_blocks: int


class EngineDead(msgspec.Struct, array_like=True):
    """The engine core failed (or its process died); every pending request gets this."""

    message: str


class MessageType(bytes, enum.Enum):
    # frontend → engine core
    ADD = b"\x01"
    ABORT = b"\x02"
    UTILITY = b"\x03"
    # engine core → frontend
    OUTPUTS = b"\x10"
    UTILITY_OUTPUT = b"\x11"
    READY = b"\x12"
    ENGINE_DEAD = b"\x13"


_TYPES: dict[MessageType, type[msgspec.Struct]] = {
    MessageType.ADD: EngineCoreRequest,
    MessageType.ABORT: Abort,
    MessageType.UTILITY: UtilityRequest,
    MessageType.OUTPUTS: EngineCoreOutputs,
    MessageType.UTILITY_OUTPUT: UtilityOutput,
    MessageType.READY: EngineReady,
    MessageType.ENGINE_DEAD: EngineDead,
}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind: msgspec.msgpack.Decoder(struct) for kind, struct in _TYPES.items()}


def encode(kind: MessageType, message: msgspec.Struct) -> list[bytes]:
    """The two frames of one message."""
    if not isinstance(message, _TYPES[kind]):
        raise TypeError(f"{kind.name} carries {_TYPES[kind].__name__}, not {type(message).__name__}")
    return [kind.value, _ENCODER.encode(message)]


def decode(frames: list[bytes] | list[memoryview]) -> tuple[MessageType, Any]:
    kind = MessageType(bytes(frames[0]))
    return kind, _DECODERS[kind].decode(frames[1])
