"""The OpenAI API's request and response bodies (pydantic), with shoal's extra sampling fields
under the names vLLM gives them.

Requests are parsed in strict mode: a wrong JSON type (`"max_tokens": "5"`, `"logprobs": true`
on /v1/completions) is a 400, never silently coerced. vLLM's and OpenAI's fields that shoal
does not implement are declared and refused unless they ask for nothing (`refused_fields.py`);
other unknown fields are ignored, as clients send fields of their own. Values are checked
where they become `SamplingParams`, so each rule lives in one place (structured output and
logit_bias in `sampling_extensions.py`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from shoal.entrypoints.openai.json_limits import check_json_value
from shoal.entrypoints.openai.refused_fields import RefusedChatFields, RefusedCompletionFields, RefusedSamplingFields
from shoal.sampling_params import (
    MAX_BEAM_WIDTH,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# The most completions one request may ask for (OpenAI's limit).
MAX_N = 128
# Integers have bounds: token ids and counts 32-bit, seeds 64-bit signed (as OpenAI and vLLM).
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _integral(value: Any) -> Any:
    """JSON has one number type: `2.0` is the integer 2 (as JSON Schema's "integer" says)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**constraints: Any) -> Any:
    """An integer field: strict (no "5"), but an integral JSON number such as 2.0 is accepted;
    `constraints` as `Field` takes them."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


def _not_whole_vocabulary(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value == -1:
        raise ValueError(
            f"-1 (every token of the vocabulary) is not supported: ask for at most {MAX_LOGPROBS} per position"
        )
    return value


# The constrained types the schema states and pydantic enforces (each a 400 when broken).
# `x-shoal-bound`: the schema's maximum comes from the served model (openapi.py): its vocabulary
# size for token ids, its context for max_tokens.
NonEmptyText = Annotated[str, Field(min_length=1)]
# A structured-output choice: text without NUL characters (the grammar library's regexes cannot hold them).
ChoiceText = Annotated[str, Field(min_length=1, pattern=r"^[^\x00]+$")]
TokenId = integer(ge=0, le=INT32_MAX, json_schema_extra={"x-shoal-bound": "vocab"})
Count = integer(ge=0, le=INT32_MAX)
MaxTokens = integer(ge=0, le=INT32_MAX, json_schema_extra={"x-shoal-bound": "context"})
PositiveMaxTokens = integer(ge=1, le=INT32_MAX, json_schema_extra={"x-shoal-bound": "context"})
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
# vLLM's -1 (the whole vocabulary) gets a 400 that says so.
NumLogprobs = Annotated[integer(ge=0, le=MAX_LOGPROBS), BeforeValidator(_not_whole_vocabulary)]
LogitBias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]


def _keeps_a_token(value: int) -> int:
    if value == 0:
        raise ValueError("0 would keep no prompt token: give a count of at least 1, or -1")
    return value


# vLLM's truncate_prompt_tokens: keep N prompt tokens, or -1: as many as fit with max_tokens.
TruncatePromptTokens = Annotated[
    integer(ge=-1, le=INT64_MAX, json_schema_extra={"not": {"const": 0}}), AfterValidator(_keeps_a_token)
]
# A client's request id (vLLM's `request_id`): the response's id is built from it.
ClientRequestId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")]


def unless_none(**kwargs: Any) -> Any:
    """A response field vLLM adds to OpenAI's: left out of the JSON unless it was asked for."""
    return Field(default=None, exclude_if=lambda value: value is None, **kwargs)


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _as_dicts(models: list[BaseModel]) -> list[dict[str, Any]]:
    return [model.model_dump(exclude_unset=True) for model in models]


class FunctionParam(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: NonEmptyText
    description: str | None = None
    # A JSON schema of the arguments.
    parameters: dict[str, Any] | None = None


class ToolParam(RequestModel):
    """One of OpenAI's function tools. Validated as this model, then kept as the dict the client
    sent (chat templates render tools as they come)."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["function"] = "function"
    function: FunctionParam


# Tools arrive as `ToolParam`s and are kept as dicts (see ToolParam).
Tools = Annotated[list[ToolParam], AfterValidator(_as_dicts)]


class NamedFunction(RequestModel):
    name: NonEmptyText


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class RequestBody(RequestModel):
    """A whole request body: before any field is read, it must be JSON of a bounded depth whose
    text can become UTF-8 (`json_limits.py`)."""

    @model_validator(mode="before")
    @classmethod
    def _check_json(cls, data: Any) -> Any:
        check_json_value(data)
        return data


class StreamOptions(RequestModel):
    """Only with `stream: true`. The usage: a last chunk with it (`include_usage`) and, with
    vLLM's `continuous_usage_stats`, every chunk with the usage so far; `continuous_usage_stats`
    alone implies `include_usage` (as vLLM, where include_usage defaults to true)."""

    include_usage: bool | None = None
    continuous_usage_stats: bool = False

    @property
    def final_usage(self) -> bool:
        return self.include_usage if self.include_usage is not None else self.continuous_usage_stats

    @property
    def chunk_usage(self) -> bool:
        return self.final_usage and self.continuous_usage_stats


class TextFormat(RequestModel):
    type: Literal["text"]


class JsonObjectFormat(RequestModel):
    type: Literal["json_object"]


class JsonSchemaSpec(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: str | None = None
    # The JSON schema the output must match (any object: {"type": "object"} when left out).
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StructuredOutputsSpec(RequestModel):
    """vLLM's structured_outputs object (sampling_extensions.py turns it into the constraint)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[ChoiceText], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


StructuredOutputsRequest = Annotated[
    StructuredOutputsSpec, AfterValidator(lambda spec: spec.model_dump(exclude_unset=True, by_alias=True))
]


# OpenAI's response_format, validated as one of its three forms and kept as the dict it was.
ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat,
    Field(discriminator="type"),
    AfterValidator(lambda fmt: fmt.model_dump(exclude_unset=True, by_alias=True)),
]


class SamplingRequest(RequestBody, RefusedSamplingFields):  # type: ignore[misc, valid-type]
    """The sampling fields /v1/completions and /v1/chat/completions share, with the ranges
    `SamplingParams` enforces (so that the schema says them); vLLM's fields shoal does not
    implement are refused (`refused_fields.py`)."""

    model: str | None = None
    n: integer(ge=1, le=MAX_N) = 1  # type: ignore[valid-type]
    temperature: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: integer(ge=INT64_MIN, le=INT64_MAX) | None = None  # type: ignore[valid-type]
    stop: NonEmptyText | list[NonEmptyText] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # shoal's extras, as vLLM names them.
    top_k: integer(ge=-1, le=INT32_MAX) | None = None  # type: ignore[valid-type]
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_token_ids: list[TokenId] | None = None
    # Token id (as a string) -> bias in [-100, 100].
    logit_bias: dict[TokenIdKey, LogitBias] | None = None
    # Structured output: OpenAI's response_format ({"type": "text" | "json_object" |
    # "json_schema", "json_schema": {"name", "schema", "strict"}}), vLLM's structured_outputs
    # object ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}) and its older
    # guided_* fields; at most one of them (see sampling_extensions.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[ChoiceText], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # Accepted and ignored: shoal has one grammar library.
    guided_decoding_backend: str | None = None
    # Only these token ids may be sampled.
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    # The prompt's logprobs (the prompt token's and this many most likely at each position).
    prompt_logprobs: NumLogprobs | None = None
    # Keep this many prompt tokens: the last ones ("left", the default) or the first ("right").
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    truncation_side: Literal["left", "right"] | None = None
    # The prompt's and each choice's token ids in the response (streamed too).
    return_token_ids: bool | None = None
    # Logprobs name tokens "token_id:<id>" rather than by their text.
    return_tokens_as_token_ids: bool | None = None
    request_id: ClientRequestId | None = None
    # Beam search (vLLM's fields): `best_of` beams (default `n`) are searched and the best `n`
    # returned, ordered by score (cumulative logprob / tokens ** length_penalty).
    use_beam_search: bool = False
    length_penalty: Annotated[float, Field(allow_inf_nan=False)] = 1.0
    best_of: integer(ge=1, le=MAX_N) | None = None  # type: ignore[valid-type]

    def to_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """Raises `ValueError` naming the bad field (`SamplingParams.<field> ...`);
        `structured_outputs` is the constraint the caller settled on (`sampling_extensions`)."""
        from shoal.entrypoints.openai.sampling_extensions import logit_bias_of

        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        optional: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=logit_bias_of(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            structured_outputs=structured_outputs,
            **{name: value for name, value in optional.items() if value is not None},
        )

    def beam_search_params(self, max_tokens: int, structured: bool) -> BeamSearchParams | None:
        """The beam search the request asks for (None: it samples). Raises `ValueError` naming
        a field that beam search cannot honour (it ranks by the model's raw logprobs, so nothing
        may reshape them; `structured`: the request has a structured-output constraint)."""
        if not self.use_beam_search:
            if self.best_of is not None and self.best_of != self.n:
                raise ValueError("best_of (other than n) needs use_beam_search: true")
            if self.length_penalty != 1.0:
                raise ValueError("length_penalty needs use_beam_search: true")
            return None
        refused = {
            "stop": bool(self.stop),
            "stop_token_ids": bool(self.stop_token_ids),
            "logit_bias": bool(self.logit_bias),
            "min_tokens": self.min_tokens > 0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
            "top_p": self.top_p not in (None, 1.0),
            "top_k": self.top_k not in (None, 0, -1),
            "min_p": self.min_p not in (None, 0.0),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "structured output": structured,
        }
        named = [name for name, given in refused.items() if given]
        if named:
            raise ValueError(f"{', '.join(named)} cannot be combined with use_beam_search")
        beam_width = self.n if self.best_of is None else self.best_of
        if beam_width < self.n:
            raise ValueError(f"best_of must be at least n ({self.n}) with use_beam_search, got {beam_width}")
        if beam_width > MAX_BEAM_WIDTH:
            raise ValueError(
                f"use_beam_search takes at most {MAX_BEAM_WIDTH} beams (best_of, else n), got {beam_width}"
            )
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1 with use_beam_search")
        return BeamSearchParams(
            beam_width=beam_width,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature or 0.0,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    @property
    def num_sequences(self) -> int:
        """The sequences one prompt holds at once: its beams, else its `n` completions."""
        if self.use_beam_search and self.best_of is not None:
            return max(self.best_of, self.n)
        return self.n


# ---- /v1/completions ---------------------------------------------------------------------------


class CompletionRequest(SamplingRequest, RefusedCompletionFields):  # type: ignore[misc, valid-type]
    # Text, several texts, token ids, or several lists of token ids; none of them empty.
    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    # 0 scores the prompt (nothing is generated).
    max_tokens: MaxTokens | None = 16
    echo: bool = False
    logprobs: NumLogprobs | None = None
    add_special_tokens: bool = True

    # Tools are for /v1/chat/completions: the schema says no `tools` here, and a body with them is a 400.
    model_config = ConfigDict(
        strict=True,
        extra="ignore",
        json_schema_extra=lambda schema: schema["properties"].update(  # type: ignore[union-attr]
            tools={"not": {}, "description": "only for /v1/chat/completions"}
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _no_tools(cls, data: Any) -> Any:
        if isinstance(data, dict) and "tools" in data:
            raise ValueError("tools are only for /v1/chat/completions")
        return data


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class PromptLogprob(BaseModel):
    """One token's logprob at one prompt position (vLLM's `prompt_logprobs` entries)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# Per prompt position: None for the first (nothing predicts it), then token id -> its logprob
# (the prompt's token and the most likely ones).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: `prompt_logprobs`, and with `return_token_ids` the ids (a stream: the prompt's in
    # a choice's first chunk, each chunk its new tokens').
    prompt_logprobs: PromptLogprobs | None = unless_none()
    prompt_token_ids: list[int] | None = unless_none()
    token_ids: list[int] | None = unless_none()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ----------------------------------------------------------------------


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessageParam(RequestModel):
    """One message of a conversation. Keys beyond these (name, tool_calls, tool_call_id, ...)
    are kept: chat templates read whatever they need."""

    model_config = ConfigDict(strict=True, extra="allow")

    # Any role: the chat template decides what it makes of it (as vLLM passes it on).
    role: NonEmptyText
    content: str | list[TextContentPart] | None = None

    def as_template_input(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)


Conversation = Annotated[list[ChatMessageParam], Field(min_length=1)]


class ChatCompletionRequest(SamplingRequest, RefusedChatFields):  # type: ignore[misc, valid-type]
    messages: Conversation
    max_tokens: PositiveMaxTokens | None = None
    max_completion_tokens: PositiveMaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True
    # vLLM's: continue the last message (left open, no end-of-turn) rather than start a new one.
    continue_final_message: bool = False
    # vLLM's: the answer's content starts with the last message's when that is the answer's role.
    echo: bool = False
    # vLLM's: special tokens (bos) added beyond those the template writes.
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Passed to the chat template (as vLLM does): retrieval documents, a reasoning effort.
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's: false leaves reasoning_content out of the answer.
    include_reasoning: bool = True
    tools: Tools | None = None
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}} (kept as a dict)
    tool_choice: (
        Literal["none", "auto", "required"] | Annotated[NamedToolChoice, AfterValidator(BaseModel.model_dump)] | None
    ) = None
    parallel_tool_calls: bool = True

    model_config = ConfigDict(
        strict=True,
        extra="ignore",
        # top_logprobs needs logprobs: true (a rule across two fields, stated for the schema's readers).
        json_schema_extra={
            "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        },
    )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: str
    content: str | None = None
    # The thinking part of a reasoning model's answer (`--reasoning-parser`), as vLLM names it.
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = unless_none()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = unless_none()
    prompt_token_ids: list[int] | None = unless_none()


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A stream's piece of one tool call: the first carries its id, type and name, the later
    ones pieces of its arguments (which, joined, are its JSON text)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = unless_none()


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    # With return_token_ids: in each choice's first chunk.
    prompt_token_ids: list[int] | None = unless_none()


# ---- models, tokenizer, errors ------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "shoal"
    root: str | None = None
    # A LoRA adapter's base model (None: a base model).
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ServerLoad(BaseModel):
    """`GET /load`: the requests being answered now (vLLM's route and field)."""

    server_load: int


class TokenizeRequest(RequestBody):
    """Either `prompt` (text) or `messages` (a conversation, rendered with the chat template):
    exactly one of them (the schema's `oneOf`)."""

    model_config = ConfigDict(
        strict=True,
        extra="ignore",
        json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]},
    )

    model: str | None = None
    # Not nullable: absent is how a client leaves one of them out.
    prompt: str = Field(default=None)  # type: ignore[assignment]
    messages: Conversation = Field(default=None)  # type: ignore[assignment]
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    # Rendered by the chat template with `messages`, as /v1/chat/completions renders them.
    tools: Tools | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
