"""`POST /v1/chat/completions`: a conversation rendered with the model's chat template.

A stream sends, for each of the `n` choices, a first chunk with `role: "assistant"`, then deltas;
each choice's last chunk carries its `finish_reason`. Logprobs use the chat format: per token,
its text, logprob and UTF-8 bytes, and the `top_logprobs` most likely tokens.

Tools are rendered by the chat template; what the model writes is read by the tool plan's
parser (`tool_choice.py`) into `tool_calls` (streamed as `delta.tool_calls`), with
`finish_reason: "tool_calls"`. A reasoning parser (`--reasoning-parser`) splits the thinking
into `reasoning_content`; a structured-output constraint then applies to the answer only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from shoal.entrypoints.openai.chat_output import ChoiceOutput
from shoal.entrypoints.openai.errors import bad_request
from shoal.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    ChatMessageParam,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    now,
    random_id,
)
from shoal.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from shoal.entrypoints.openai.sampling_extensions import structured_outputs_of
from shoal.entrypoints.openai.serving import (
    OpenAIServing,
    clamp_logprob,
    merge_streams,
    sse_event,
    usage,
)
from shoal.entrypoints.openai.serving_limits import Admission, ServingLimits
from shoal.entrypoints.openai.tool_choice import ToolPlan, plan_tools
from shoal.frontend.chat import render_chat
from shoal.frontend.output_processor import OutputKind
from shoal.outputs import CompletionOutput, Logprob, RequestOutput
from shoal.sampling_params import BeamSearchParams, SamplingParams
from shoal.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from shoal.frontend.async_llm import AsyncLLM

_ASSISTANT = "assistant"


@dataclass(frozen=True)
class ChatOptions:
    """The server's settings for chat outputs (`shoal serve` flags, vLLM's names)."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None


@dataclass
class _Chat:
    """One chat request as the handlers run it."""

    request: ChatCompletionRequest
    request_id: str
    prompt: dict[str, Any]
    params: SamplingParams | BeamSearchParams
    tools: ToolPlan

    def generate(self, serving: OpenAIServing, kind: OutputKind) -> AsyncIterator[RequestOutput]:
        request = self.request
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        return serving.generate(self.prompt, self.params, self.request_id, kind, request.n, num_logprobs)

    def choice_output(self, reasoning: ReasoningParser | None) -> ChoiceOutput:
        return ChoiceOutput(reasoning, self.tools.parser)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLM,
        tokenizer_thread: ThreadPoolExecutor,
        options: ChatOptions | None = None,
        limits: ServingLimits | None = None,
        admission: Admission | None = None,
    ):
        super().__init__(engine, tokenizer_thread, limits, admission)
        self.options = options or ChatOptions()
        self.reasoning = get_reasoning_parser(self.options.reasoning_parser) if self.options.reasoning_parser else None

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        deadline = self.deadline()
        chat = await self._prepare(request)
        ticket = self.admit(request.num_sequences)
        if request.stream:
            return self.sse_response(self._stream(chat, deadline), ticket)
        result = await self.until_done(raw_request, self._complete(chat, deadline), ticket)
        return result if isinstance(result, Response) else JSONResponse(result.model_dump())

    async def _prepare(self, request: ChatCompletionRequest) -> _Chat:
        """Validate, render and settle the request's sampling parameters (a 400 for anything
        wrong, before the engine sees it)."""
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        options = self.options
        tools = plan_tools(
            request.tools,
            request.tool_choice,
            request.parallel_tool_calls,
            options.tool_call_parser,
            options.enable_auto_tool_choice,
        )
        structured = structured_outputs_of(request)
        if tools.constraint is not None:
            if structured is not None:
                raise bad_request('tool_choice "required" or a named function cannot be combined with response_format')
            structured = tools.constraint
        text, token_ids = await self.render(
            request.messages,
            request.add_generation_prompt,
            request.chat_template,
            request.chat_template_kwargs,
            request.tools,
        )
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if request.max_tokens is not None and request.max_tokens >= self.max_model_len:  # even when overridden
            raise bad_request(f"max_tokens must be below the maximum context length {self.max_model_len}", "max_tokens")
        self.check_prompt(token_ids, max_tokens, "messages")
        self.kv_cache_fit.check(len(token_ids), request.num_sequences, max_tokens)
        params = request.to_sampling_params(
            max_tokens,
            (request.top_logprobs or 0) if request.logprobs else None,
            structured_outputs=self._after_reasoning(structured, text),
        )
        if tools.parser is not None and tools.parser.special_tokens:
            params = params.clone(skip_special_tokens=False)  # the parser reads its marker tokens
        await self.check_params(params)
        room = self.max_model_len - len(token_ids)
        beam = request.beam_search_params(room if max_tokens is None else max_tokens, structured is not None)
        prompt = {"prompt_token_ids": token_ids, "prompt": text}
        return _Chat(request, random_id("chatcmpl"), prompt, beam or params, tools)

    def _after_reasoning(
        self, structured: StructuredOutputsParams | None, prompt: str
    ) -> StructuredOutputsParams | None:
        """With a reasoning parser, the constraint starts after the model's thinking ends
        (unless the template already ended it)."""
        if structured is None or self.reasoning is None or self.reasoning.prompt_ends_thinking(prompt):
            return structured
        return msgspec.structs.replace(structured, reasoning_end_token_ids=self.reasoning.end_token_ids(self.tokenizer))

    async def render(
        self,
        messages: list[ChatMessageParam] | list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """The prompt text and token ids of a conversation (raises `ValueError` for a bad one)."""
        conversation = [
            _with_text_content(m.as_template_input() if isinstance(m, ChatMessageParam) else m) for m in messages
        ]
        return await self.in_tokenizer_thread(
            render_chat, self.tokenizer, conversation, add_generation_prompt, chat_template, chat_template_kwargs, tools
        )

    # ---- one response ---------------------------------------------------------------------------

    async def _complete(self, chat: _Chat, deadline: float | None) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        stream = chat.generate(self, OutputKind.FINAL_ONLY)
        async for _, output in self.bounded(merge_streams([stream]), deadline):
            final = output
        assert final is not None
        request = chat.request
        choices = []
        for completion in sorted(final.outputs, key=lambda c: c.index):
            reasoning, content, tool_calls = chat.choice_output(self.reasoning).message(completion.text)
            choices.append(
                ChatCompletionChoice(
                    index=completion.index,
                    message=ChatMessage(
                        role=_ASSISTANT, content=content, reasoning_content=reasoning, tool_calls=tool_calls
                    ),
                    logprobs=self._logprobs(completion, request.top_logprobs or 0) if request.logprobs else None,
                    finish_reason=_finish_reason(completion.finish_reason, bool(tool_calls)),
                    stop_reason=completion.stop_reason,
                )
            )
        num_completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(
            id=chat.request_id,
            model=self.model_name,
            choices=choices,
            usage=usage(len(final.prompt_token_ids), num_completion_tokens),
        )

    # ---- a stream -------------------------------------------------------------------------------

    async def _stream(self, chat: _Chat, deadline: float | None) -> AsyncIterator[str]:
        request, request_id = chat.request, chat.request_id
        created = now()
        options = request.stream_options
        num_prompt_tokens = len(chat.prompt["prompt_token_ids"])
        num_completion_tokens = 0
        outputs = [chat.choice_output(self.reasoning) for _ in range(request.n)]

        def chunk(choices: list[ChatCompletionStreamChoice]) -> str:
            chunk_usage = None
            if options is not None and options.continuous_usage_stats:
                chunk_usage = usage(num_prompt_tokens, num_completion_tokens)
            response = ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=chunk_usage
            )
            return sse_event(response)

        for index in range(request.n):
            yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role=_ASSISTANT, content=""))])
        stream = chat.generate(self, OutputKind.DELTA)
        async for _, output in self.bounded(merge_streams([stream]), deadline):
            for completion in output.outputs:
                num_completion_tokens += len(completion.token_ids)
                choice = self._stream_choice(request, completion, outputs[completion.index])
                if choice is not None:
                    yield chunk([choice])
        if options is not None and options.include_usage:
            final = ChatCompletionStreamResponse(
                id=request_id,
                created=created,
                model=self.model_name,
                choices=[],
                usage=usage(num_prompt_tokens, num_completion_tokens),
            )
            yield sse_event(final)

    def _stream_choice(
        self, request: ChatCompletionRequest, completion: CompletionOutput, output: ChoiceOutput
    ) -> ChatCompletionStreamChoice | None:
        """A choice's chunk for one engine delta; None when there is nothing new to say yet
        (text held back for a possible stop string or marker)."""
        finished = completion.finish_reason is not None
        delta = output.delta(completion.text, final=finished)
        logprobs = None
        if request.logprobs and completion.token_ids:
            logprobs = self._logprobs(completion, request.top_logprobs or 0)
        if delta is None and not finished and logprobs is None:
            return None
        return ChatCompletionStreamChoice(
            index=completion.index,
            delta=delta or DeltaMessage(),
            logprobs=logprobs,
            finish_reason=_finish_reason(completion.finish_reason, output.num_tool_calls_sent > 0),
            stop_reason=completion.stop_reason,
        )

    def _logprobs(self, completion: CompletionOutput, num_top: int) -> ChatLogprobs:
        content = []
        for token_id, row in zip(completion.token_ids, completion.logprobs or []):
            sampled = row.get(token_id) or next(iter(row.values()))
            top = sorted(row.items(), key=lambda item: item[1].rank)[:num_top]
            content.append(
                ChatTokenLogprob(
                    **self._top_logprob(token_id, sampled).model_dump(),
                    top_logprobs=[self._top_logprob(tid, lp) for tid, lp in top],
                )
            )
        return ChatLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: Logprob) -> TopLogprob:
        token = logprob.decoded_token if logprob.decoded_token is not None else self.decode_token(token_id)
        return TopLogprob(token=token, logprob=clamp_logprob(logprob.logprob), bytes=list(token.encode("utf-8")))


def _finish_reason(finish_reason: str | None, has_tool_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for a choice that ended (not cut off) with tool calls."""
    return "tool_calls" if finish_reason == "stop" and has_tool_calls else finish_reason


def _with_text_content(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts (`[{"type": "text", "text": ...}, ...]`) joined into one string;
    shoal's models read text only."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}
