"""`POST /v1/completions`: one or several prompts (text or token ids), `n` completions each.

Choice `i * n + j` is completion j of prompt i. With `echo`, each choice's text starts with its
prompt (and, with `logprobs`, the prompt's logprobs come first, the first token's being null).
Logprobs use the legacy completions format: `tokens`, `token_logprobs`, `top_logprobs` (the
top-N and the sampled token, by decoded text) and `text_offset` (each token's character offset
in the choice's text, counted over the decoded tokens).

`max_tokens: 0` scores a prompt: nothing is generated (with `echo` and `logprobs`, the prompt's
logprobs are the answer). The engine computes the prompt's logprobs while it prefills, and the
token that prefill samples is dropped here.

vLLM's fields: `prompt_logprobs` (each choice's `prompt_logprobs`), `return_token_ids` (each
choice's `prompt_token_ids` and `token_ids`; streamed, the prompt's in a choice's first chunk),
`return_tokens_as_token_ids` (logprobs name tokens "token_id:<id>"; `text_offset` still counts
the text), `truncate_prompt_tokens` / `truncation_side` (the echoed prompt is what was kept).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from shoal.entrypoints.openai.errors import bad_request
from shoal.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobs,
    now,
)
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
from shoal.frontend.output_processor import OutputKind
from shoal.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from shoal.sampling_params import BeamSearchParams, SamplingParams

TokenizedPrompt = tuple[str | None, list[int]]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        check_stream_fields(request)
        deadline = self.deadline()
        prompts = [self._truncated(p, request) for p in await self._tokenize_prompts(request)]
        for _, token_ids in prompts:
            self.check_prompt(token_ids, request.max_tokens, "prompt")
            self.kv_cache_fit.check(len(token_ids), request.num_sequences, request.max_tokens)
        # Scoring (max_tokens 0): the engine samples one token after the prompt, dropped in _scored.
        max_tokens = 1 if request.max_tokens == 0 else request.max_tokens
        structured = structured_outputs_of(request)
        params = request.to_sampling_params(
            max_tokens,
            request.logprobs,
            prompt_logprobs=_num_prompt_logprobs(request),
            structured_outputs=structured,
        )
        await self.check_params(params)
        max_new_tokens = self.max_model_len if request.max_tokens is None else request.max_tokens
        engine_params = request.beam_search_params(max_new_tokens, structured is not None) or params
        if isinstance(engine_params, BeamSearchParams) and params.prompt_logprobs is not None:
            raise bad_request(
                "prompt logprobs (echo with logprobs, prompt_logprobs) cannot be combined with use_beam_search", "echo"
            )
        ticket = self.admit(len(prompts) * request.num_sequences)
        request_id = response_id("cmpl", request)
        if request.stream:
            return self.sse_response(self._stream(request, request_id, prompts, engine_params, deadline), ticket)
        work = self._complete(request, request_id, prompts, engine_params, deadline)
        result = await self.until_done(raw_request, work, ticket)
        return result if isinstance(result, Response) else JSONResponse(result.model_dump())

    async def _tokenize_prompts(self, request: CompletionRequest) -> list[TokenizedPrompt]:
        prompt = request.prompt
        if isinstance(prompt, str):
            prompt_list: list[str | list[int]] = [prompt]
        elif not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        elif isinstance(prompt[0], int):
            prompt_list = [prompt]
        else:
            prompt_list = list(prompt)
        return await self.in_tokenizer_thread(self._tokenize_all, prompt_list, request.add_special_tokens)

    def _truncated(self, prompt: TokenizedPrompt, request: CompletionRequest) -> TokenizedPrompt:
        """A prompt cut to `truncate_prompt_tokens`; its text is then the kept tokens' (echo)."""
        text, token_ids = prompt
        kept = self.truncated(token_ids, request, request.max_tokens)
        return (text, token_ids) if kept is token_ids else (None, kept)

    def _tokenize_all(self, prompts: list[str | list[int]], add_special_tokens: bool) -> list[TokenizedPrompt]:
        return [
            (p, list(self.tokenizer.encode(p, add_special_tokens=add_special_tokens)))
            if isinstance(p, str)
            else (None, list(p))
            for p in prompts
        ]

    def _generate_all(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[TokenizedPrompt],
        params: SamplingParams | BeamSearchParams,
        kind: OutputKind,
    ) -> list[AsyncIterator[RequestOutput]]:
        return [
            self.generate(
                {"prompt_token_ids": token_ids, "prompt": text},
                params,
                f"{request_id}-{i}",
                kind,
                request.n,
                request.logprobs,
                request.model,
            )
            for i, (text, token_ids) in enumerate(prompts)
        ]

    # ---- one response ---------------------------------------------------------------------------

    async def _complete(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[TokenizedPrompt],
        params: SamplingParams | BeamSearchParams,
        deadline: float | None,
    ) -> CompletionResponse:
        final: dict[int, RequestOutput] = {}
        streams = self._generate_all(request, request_id, prompts, params, OutputKind.FINAL_ONLY)
        async for i, output in self.bounded(merge_streams(streams), deadline):
            final[i] = output
        choices = []
        num_prompt_tokens = num_completion_tokens = 0
        for i in range(len(prompts)):
            output = final[i]
            num_prompt_tokens += len(output.prompt_token_ids)
            for completion in sorted(output.outputs, key=lambda c: c.index):
                completion = _scored(completion) if request.max_tokens == 0 else completion
                num_completion_tokens += len(completion.token_ids)
                text, logprobs, _ = self._choice_body(request, output, completion, with_prompt=request.echo)
                choices.append(
                    CompletionChoice(
                        index=i * request.n + completion.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        prompt_logprobs=_prompt_logprobs(request, output),
                        prompt_token_ids=output.prompt_token_ids if request.return_token_ids else None,
                        token_ids=completion.token_ids if request.return_token_ids else None,
                    )
                )
        return CompletionResponse(
            id=request_id,
            model=self.response_model(request.model),
            choices=choices,
            usage=usage(num_prompt_tokens, num_completion_tokens),
        )

    def _choice_body(
        self,
        request: CompletionRequest,
        output: RequestOutput,
        completion: CompletionOutput,
        with_prompt: bool,
        text_offset: int = 0,
    ) -> tuple[str, CompletionLogprobs | None, int]:
        """A choice's text (or the part of it new in a stream chunk), its logprobs, and the
        text offset after them."""
        text = completion.text
        logprobs = CompletionLogprobs() if request.logprobs is not None else None
        if with_prompt:
            text = self._prompt_text(output) + text
            if logprobs is not None:
                rows = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
                text_offset = self._add_logprobs(request, logprobs, output.prompt_token_ids, rows, text_offset)
        if logprobs is not None:
            rows = completion.logprobs or []
            text_offset = self._add_logprobs(request, logprobs, completion.token_ids, rows, text_offset)
        return text, logprobs, text_offset

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids)

    def _add_logprobs(
        self,
        request: CompletionRequest,
        logprobs: CompletionLogprobs,
        token_ids: list[int],
        rows: Sequence[PositionLogprobs | None],
        text_offset: int,
    ) -> int:
        """Append one entry per token (its row cut to the request's `logprobs`: a prompt's rows
        may hold more for `prompt_logprobs`); returns the text offset after the last one."""
        num_top, as_ids = request.logprobs or 0, request.return_tokens_as_token_ids
        for token_id, row in zip(token_ids, rows):
            actual = row.get(token_id) if row else None
            text = self.token_name(token_id, actual.decoded_token if actual is not None else None, False)
            logprobs.tokens.append(self.token_name(token_id, text, as_ids))
            logprobs.text_offset.append(text_offset)
            text_offset += len(text)
            logprobs.token_logprobs.append(clamp_logprob(actual.logprob) if actual is not None else None)
            logprobs.top_logprobs.append(
                {
                    self.token_name(tid, lp.decoded_token, as_ids): clamp_logprob(lp.logprob)
                    for tid, lp in row.items()
                    if tid == token_id or lp.rank <= num_top
                }
                if row
                else None
            )
        return text_offset

    # ---- a stream -------------------------------------------------------------------------------

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[TokenizedPrompt],
        params: SamplingParams | BeamSearchParams,
        deadline: float | None,
    ) -> AsyncIterator[str]:
        created = now()
        num_choices = len(prompts) * request.n
        text_offsets = [0] * num_choices
        started = [False] * num_choices
        num_prompt_tokens = sum(len(token_ids) for _, token_ids in prompts)
        num_completion_tokens = 0
        options = request.stream_options
        streams = self._generate_all(request, request_id, prompts, params, OutputKind.DELTA)
        async for i, output in self.bounded(merge_streams(streams), deadline):
            for completion in output.outputs:
                completion = _scored(completion) if request.max_tokens == 0 else completion
                index = i * request.n + completion.index
                num_completion_tokens += len(completion.token_ids)
                first = not started[index]
                with_prompt = request.echo and first
                text, logprobs, text_offsets[index] = self._choice_body(
                    request, output, completion, with_prompt, text_offsets[index]
                )
                token_ids = completion.token_ids if request.return_token_ids else None
                if not (text or token_ids or completion.finish_reason is not None or (logprobs and logprobs.tokens)):
                    continue  # nothing new to say yet (text held back for a possible stop string)
                started[index] = True
                choice = CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    prompt_token_ids=output.prompt_token_ids if request.return_token_ids and first else None,
                    token_ids=token_ids,
                )
                chunk_usage = None
                if options is not None and options.chunk_usage:
                    chunk_usage = usage(num_prompt_tokens, num_completion_tokens)
                chunk = CompletionResponse(
                    id=request_id,
                    created=created,
                    model=self.response_model(request.model),
                    choices=[choice],
                    usage=chunk_usage,
                )
                yield sse_event(chunk)
        if options is not None and options.final_usage:
            final = CompletionResponse(
                id=request_id,
                created=created,
                model=self.response_model(request.model),
                choices=[],
                usage=usage(num_prompt_tokens, num_completion_tokens),
            )
            yield sse_event(final)


def _num_prompt_logprobs(request: CompletionRequest) -> int | None:
    """How many logprobs per prompt position the engine computes: for `prompt_logprobs`, and
    for `echo` with `logprobs` (the echoed prompt's)."""
    asked = [request.prompt_logprobs, request.logprobs if request.echo else None]
    return max((n for n in asked if n is not None), default=None)


def _prompt_logprobs(request: CompletionRequest, output: RequestOutput) -> PromptLogprobs | None:
    if request.prompt_logprobs is None:
        return None
    return prompt_logprobs_of(output.prompt_token_ids, output.prompt_logprobs, request.prompt_logprobs)


def _scored(completion: CompletionOutput) -> CompletionOutput:
    """A completion of a scoring request (max_tokens 0): what it generated is dropped."""
    return CompletionOutput(
        index=completion.index,
        text="",
        token_ids=[],
        logprobs=[] if completion.logprobs is not None else None,
        finish_reason="length" if completion.finish_reason is not None else None,
    )
