"""`POST /v1/chat/completions`: a conversation rendered with the model's chat template.

A stream sends, for each of the `n` choices, a first chunk with `role: "assistant"`, then content
deltas; each choice's last chunk carries its `finish_reason`. Logprobs use the chat format: per
token, its text, logprob and UTF-8 bytes, and the `top_logprobs` most likely tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from shoal.entrypoints.openai.errors import bad_request
from shoal.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    now,
    random_id,
)
from shoal.entrypoints.openai.serving import (
    OpenAIServing,
    SSEResponse,
    clamp_logprob,
    merge_streams,
    sse_event,
    sse_stream,
    until_disconnected,
    usage,
)
from shoal.frontend.chat import render_chat
from shoal.frontend.output_processor import OutputKind
from shoal.outputs import CompletionOutput, Logprob, RequestOutput
from shoal.sampling_params import SamplingParams

_ASSISTANT = "assistant"


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        text, token_ids = await self.render(
            request.messages, request.add_generation_prompt, request.chat_template, request.chat_template_kwargs
        )
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        self.check_prompt(token_ids, max_tokens, "messages")
        params = request.to_sampling_params(max_tokens, (request.top_logprobs or 0) if request.logprobs else None)
        request_id = random_id("chatcmpl")
        prompt = {"prompt_token_ids": token_ids, "prompt": text}
        if request.stream:
            return SSEResponse(sse_stream(self._stream(request, request_id, prompt, params)))
        result = await until_disconnected(raw_request, self._complete(request, request_id, prompt, params))
        return result if isinstance(result, Response) else JSONResponse(result.model_dump())

    async def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The prompt text and token ids of a conversation (raises `ValueError` for a bad one)."""
        conversation = [_with_text_content(m) for m in messages]
        return await self.in_tokenizer_thread(
            render_chat, self.tokenizer, conversation, add_generation_prompt, chat_template, chat_template_kwargs
        )

    async def _complete(
        self, request: ChatCompletionRequest, request_id: str, prompt: dict[str, Any], params: SamplingParams
    ) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        async for _, output in merge_streams(
            [self.engine.generate(prompt, params, request_id, output_kind=OutputKind.FINAL_ONLY)]
        ):
            final = output
        assert final is not None
        choices = [
            ChatCompletionChoice(
                index=completion.index,
                message=ChatMessage(role=_ASSISTANT, content=completion.text),
                logprobs=self._logprobs(completion, request.top_logprobs or 0) if request.logprobs else None,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            for completion in sorted(final.outputs, key=lambda c: c.index)
        ]
        num_completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=usage(len(final.prompt_token_ids), num_completion_tokens),
        )

    async def _stream(
        self, request: ChatCompletionRequest, request_id: str, prompt: dict[str, Any], params: SamplingParams
    ) -> AsyncIterator[str]:
        created = now()
        options = request.stream_options
        num_prompt_tokens = len(prompt["prompt_token_ids"])
        num_completion_tokens = 0

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
        stream = self.engine.generate(prompt, params, request_id, output_kind=OutputKind.DELTA)
        async for _, output in merge_streams([stream]):
            for completion in output.outputs:
                num_completion_tokens += len(completion.token_ids)
                logprobs = None
                if request.logprobs and completion.token_ids:
                    logprobs = self._logprobs(completion, request.top_logprobs or 0)
                if not completion.text and completion.finish_reason is None and logprobs is None:
                    continue  # nothing new to say yet (text held back for a possible stop string)
                choice = ChatCompletionStreamChoice(
                    index=completion.index,
                    delta=DeltaMessage(content=completion.text) if completion.text else DeltaMessage(),
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
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
