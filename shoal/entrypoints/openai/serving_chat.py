"""`POST /v1/chat/completions`: a conversation rendered with the model's chat template.

A stream sends, for each of the `n` choices, a first chunk with `role: "assistant"`, then deltas;
each choice's last chunk carries its `finish_reason`. Logprobs use the chat format: per token,
its text, logprob and UTF-8 bytes, and the `top_logprobs` most likely tokens.

Tools are rendered by the chat template; what the model writes is read by the tool plan's
parser (`tool_choice.py`) into `tool_calls` (streamed as `delta.tool_calls`), with
`finish_reason: "tool_calls"`. A reasoning parser (`--reasoning-parser`) splits the thinking
into `reasoning_content`; a structured-output constraint then applies to the answer only. Where
the model cannot think (the prompt closed the thinking, or the tokenizer has no single token for
each marker) the whole output is the answer.

vLLM's fields: `continue_final_message` (the last message is continued, the template's
generation prompt left out), `echo` (the answer's content starts with the last message's when
that is the answer's role: "assistant", or with `add_generation_prompt: false` the last
message's), `prompt_logprobs` (and with `echo` and `logprobs`, `top_logprobs` of them; the
response's `prompt_logprobs`), `return_token_ids` (the response's `prompt_token_ids`, each
choice's `token_ids`; streamed: the prompt's in each choice's first chunk),
`return_tokens_as_token_ids`, `truncate_prompt_tokens`, `add_special_tokens`, `documents` and
`reasoning_effort` (to the template), `include_reasoning`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
)
from shoal.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from shoal.entrypoints.openai.sampling_extensions import structured_outputs_of
from shoal.entrypoints.openai.serving import (
    OpenAIServing,
    check_stream_fields,
    clamp_logprob,
    merge_streams,
    prompt_logprobs_of,
    response_id,
    sse_event,
    usage,
)
from shoal.entrypoints.openai.serving_limits import Admission, ServingLimits
from shoal.entrypoints.openai.tool_choice import ToolPlan, plan_tools
from shoal.frontend.chat import render_chat, template_message
from shoal.frontend.output_processor import OutputKind
from shoal.outputs import CompletionOutput, Logprob, RequestOutput
from shoal.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from shoal.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

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
    reasoning: ReasoningParser | None  # None: the whole output is the answer
    # The answer's role, and (with echo) the text its content starts with.
    role: str = _ASSISTANT
    echo: str | None = None

    def generate(self, serving: OpenAIServing, kind: OutputKind) -> AsyncIterator[RequestOutput]:
        request = self.request
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        return serving.generate(self.prompt, self.params, self.request_id, kind, request.n, num_logprobs, request.model)

    def choice_output(self) -> ChoiceOutput:
        return ChoiceOutput(self.reasoning, self.tools.parser)


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
        self.thinking_tokens = None
        if self.reasoning is not None and self.tokenizer is not None:
            self.thinking_tokens = self.reasoning.marker_token_ids(self.tokenizer)
            if self.thinking_tokens is None:
                logger.warning(
                    "--reasoning-parser %s: the tokenizer has no single token for %s and %s, so the model "
                    "cannot think: its outputs are read as answers",
                    self.reasoning.name,
                    self.reasoning.start,
                    self.reasoning.end,
                )

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
        check_stream_fields(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        add_generation_prompt = _add_generation_prompt(request)
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
            add_generation_prompt,
            request.chat_template,
            _template_kwargs(request),
            request.tools,
            request.continue_final_message,
            request.add_special_tokens,
        )
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if request.max_tokens is not None and request.max_tokens >= self.max_model_len:  # even when overridden
            raise bad_request(f"max_tokens must be below the maximum context length {self.max_model_len}", "max_tokens")
        kept = self.truncated(token_ids, request, max_tokens)
        self.check_prompt(kept, max_tokens, "messages")
        self.kv_cache_fit.check(len(kept), request.num_sequences, max_tokens)
        reasoning = self._reasoning_after(text)
        if reasoning is not None and structured is not None:
            assert self.thinking_tokens is not None
            structured = reasoning.constrain_answer(structured, self.thinking_tokens)
        params = request.to_sampling_params(
            max_tokens,
            (request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=_num_prompt_logprobs(request),
            structured_outputs=structured,
        )
        if tools.parser is not None and tools.parser.special_tokens:
            params = params.clone(skip_special_tokens=False)  # the parser reads its marker tokens
        await self.check_params(params)
        room = self.max_model_len - len(kept)
        beam = request.beam_search_params(room if max_tokens is None else max_tokens, structured is not None)
        if beam is not None and params.prompt_logprobs is not None:
            raise bad_request(
                "prompt logprobs (prompt_logprobs, echo with logprobs) cannot be combined with use_beam_search",
                "prompt_logprobs",
            )
        prompt = {"prompt_token_ids": kept, "prompt": text if kept is token_ids else None}
        role = _ASSISTANT if add_generation_prompt else request.messages[-1].role
        echo = _echoed(request, role)
        return _Chat(request, response_id("chatcmpl", request), prompt, beam or params, tools, reasoning, role, echo)

    def _reasoning_after(self, prompt: str) -> ReasoningParser | None:
        """The reasoning parser, where the model may think after `prompt`."""
        if self.reasoning is None or self.thinking_tokens is None or self.reasoning.prompt_ends_thinking(prompt):
            return None
        return self.reasoning

    async def render(
        self,
        messages: list[ChatMessageParam] | list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> tuple[str, list[int]]:
        """The prompt text and token ids of a conversation (raises `ValueError` for a bad one)."""
        conversation = [m.as_template_input() if isinstance(m, ChatMessageParam) else m for m in messages]
        render = functools.partial(
            render_chat, continue_final_message=continue_final_message, add_special_tokens=add_special_tokens
        )
        return await self.in_tokenizer_thread(
            render, self.tokenizer, conversation, add_generation_prompt, chat_template, chat_template_kwargs, tools
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
            reasoning, content, tool_calls = chat.choice_output().message(completion.text)
            if chat.echo is not None:
                content = chat.echo + (content or "")
            choices.append(
                ChatCompletionChoice(
                    index=completion.index,
                    message=ChatMessage(
                        role=chat.role,
                        content=content,
                        reasoning_content=reasoning if request.include_reasoning else None,
                        tool_calls=tool_calls,
                    ),
                    logprobs=self._logprobs(request, completion) if request.logprobs else None,
                    finish_reason=_finish_reason(completion.finish_reason, bool(tool_calls)),
                    stop_reason=completion.stop_reason,
                    token_ids=completion.token_ids if request.return_token_ids else None,
                )
            )
        num_completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        prompt_logprobs = None
        if isinstance(chat.params, SamplingParams) and chat.params.prompt_logprobs is not None:
            num_top = chat.params.prompt_logprobs
            prompt_logprobs = prompt_logprobs_of(final.prompt_token_ids, final.prompt_logprobs, num_top)
        return ChatCompletionResponse(
            id=chat.request_id,
            model=self.response_model(request.model),
            choices=choices,
            usage=usage(len(final.prompt_token_ids), num_completion_tokens),
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=final.prompt_token_ids if request.return_token_ids else None,
        )

    # ---- a stream -------------------------------------------------------------------------------

    async def _stream(self, chat: _Chat, deadline: float | None) -> AsyncIterator[str]:
        request, request_id = chat.request, chat.request_id
        created = now()
        options = request.stream_options
        num_prompt_tokens = len(chat.prompt["prompt_token_ids"])
        num_completion_tokens = 0
        outputs = [chat.choice_output() for _ in range(request.n)]

        def chunk(choices: list[ChatCompletionStreamChoice], prompt_token_ids: list[int] | None = None) -> str:
            chunk_usage = None
            if options is not None and options.chunk_usage:
                chunk_usage = usage(num_prompt_tokens, num_completion_tokens)
            response = ChatCompletionStreamResponse(
                id=request_id,
                created=created,
                model=self.response_model(request.model),
                choices=choices,
                usage=chunk_usage,
                prompt_token_ids=prompt_token_ids,
            )
            return sse_event(response)

        prompt_token_ids = chat.prompt["prompt_token_ids"] if request.return_token_ids else None
        for index in range(request.n):
            first = DeltaMessage(role=chat.role, content=chat.echo or "")
            yield chunk([ChatCompletionStreamChoice(index=index, delta=first)], prompt_token_ids)
        stream = chat.generate(self, OutputKind.DELTA)
        async for _, output in self.bounded(merge_streams([stream]), deadline):
            for completion in output.outputs:
                num_completion_tokens += len(completion.token_ids)
                choice = self._stream_choice(request, completion, outputs[completion.index])
                if choice is not None:
                    yield chunk([choice])
        if options is not None and options.final_usage:
            final = ChatCompletionStreamResponse(
                id=request_id,
                created=created,
                model=self.response_model(request.model),
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
        if delta is not None and not request.include_reasoning:
            delta.reasoning_content = None
            delta = delta if delta.content or delta.tool_calls else None
        logprobs = None
        if request.logprobs and completion.token_ids:
            logprobs = self._logprobs(request, completion)
        token_ids = completion.token_ids if request.return_token_ids else None
        if delta is None and not finished and logprobs is None and not token_ids:
            return None
        return ChatCompletionStreamChoice(
            index=completion.index,
            delta=delta or DeltaMessage(),
            logprobs=logprobs,
            finish_reason=_finish_reason(completion.finish_reason, output.num_tool_calls_sent > 0),
            stop_reason=completion.stop_reason,
            token_ids=token_ids,
        )

    def _logprobs(self, request: ChatCompletionRequest, completion: CompletionOutput) -> ChatLogprobs:
        num_top, as_ids = request.top_logprobs or 0, request.return_tokens_as_token_ids
        content = []
        for token_id, row in zip(completion.token_ids, completion.logprobs or []):
            sampled = row.get(token_id) or next(iter(row.values()))
            top = sorted(row.items(), key=lambda item: item[1].rank)[:num_top]
            content.append(
                ChatTokenLogprob(
                    **self._top_logprob(token_id, sampled, as_ids).model_dump(),
                    top_logprobs=[self._top_logprob(tid, lp, as_ids) for tid, lp in top],
                )
            )
        return ChatLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: Logprob, as_ids: bool | None) -> TopLogprob:
        token = self.token_name(token_id, logprob.decoded_token, as_ids)
        return TopLogprob(token=token, logprob=clamp_logprob(logprob.logprob), bytes=list(token.encode("utf-8")))


def _add_generation_prompt(request: ChatCompletionRequest) -> bool:
    """Whether the template adds the generation prompt: not when the last message is continued
    (`continue_final_message` implies `add_generation_prompt: false`; both true is a 400)."""
    if not request.continue_final_message:
        return request.add_generation_prompt
    if request.add_generation_prompt and "add_generation_prompt" in request.model_fields_set:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true: continuing the last "
            "message leaves out the prompt of a new one",
            "continue_final_message",
        )
    return False


def _template_kwargs(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """The chat template's variables: `chat_template_kwargs`, with `documents` and
    `reasoning_effort` (vLLM passes these two to the template)."""
    extra = {"documents": request.documents, "reasoning_effort": request.reasoning_effort}
    given = {name: value for name, value in extra.items() if value is not None}
    if not given:
        return request.chat_template_kwargs
    return {**(request.chat_template_kwargs or {}), **given}


def _num_prompt_logprobs(request: ChatCompletionRequest) -> int | None:
    """`prompt_logprobs`, or with `echo` and `logprobs`, `top_logprobs` of them (vLLM's echo);
    a stream has none."""
    if request.prompt_logprobs is not None or request.stream:
        return request.prompt_logprobs
    return (request.top_logprobs or 0) if request.echo and request.logprobs else None


def _echoed(request: ChatCompletionRequest, role: str) -> str | None:
    """With `echo`, the last message's text when it has the answer's role (the answer's
    content starts with it)."""
    last = request.messages[-1]
    if not request.echo or last.role != role:
        return None
    content = template_message(last.as_template_input()).get("content")
    return content if isinstance(content, str) else None


def _finish_reason(finish_reason: str | None, has_tool_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for a choice that ended (not cut off) with tool calls."""
    return "tool_calls" if finish_reason == "stop" and has_tool_calls else finish_reason
