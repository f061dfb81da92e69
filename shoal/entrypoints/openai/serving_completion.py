"""`POST /v1/completions`: one or several prompts (text or token ids), `n` completions each.

Choice `i * n + j` is completion j of prompt i. With `echo`, each choice's text starts with its
prompt (and, with `logprobs`, the prompt's logprobs come first, the first token's being null).
Logprobs use the legacy completions format: `tokens`, `token_logprobs`, `top_logprobs` (the
top-N and the sampled token, by decoded text) and `text_offset` (each token's character offset
in the choice's text, counted over the decoded tokens).

`max_tokens: 0` scores a prompt: nothing is generated (with `echo` and `logprobs`, the prompt's
logprobs are the answer). The engine computes the prompt's logprobs while it prefills, and the
token that prefill samples is dropped here.
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
    now,
    random_id,
)
from shoal.entrypoints.openai.sampling_extensions import structured_outputs_of
from shoal.entrypoints.openai.serving import (
    OpenAIServing,
    clamp_logprob,
    merge_streams,
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
        deadline = self.deadline()
        prompts = await self._tokenize_prompts(request)
        for _, token_ids in prompts:
            self.check_prompt(token_ids, request.max_tokens, "prompt")
            self.kv_cache_fit.check(len(token_ids), request.num_sequences, request.max_tokens)
        echo_logprobs = request.logprobs if request.echo else None
        # Scoring (max_tokens 0): the engine samples one token after the prompt, dropped in _scored.
        max_tokens = 1 if request.max_tokens == 0 else request.max_tokens
        structured = structured_outputs_of(request)
        params = request.to_sampling_params(
            max_tokens,
            request.logprobs,
            prompt_logprobs=echo_logprobs,
            structured_outputs=structured,
        )
        await self.check_params(params)
        max_new_tokens = self.max_model_len if request.max_tokens is None else request.max_tokens
        engine_params = request.beam_search_params(max_new_tokens, structured is not None) or params
        if isinstance(engine_params, BeamSearchParams) and echo_logprobs is not None:
            raise bad_request("echo with logprobs (the prompt's) cannot be combined with use_beam_search", "echo")
        ticket = self.admit(len(prompts) * request.num_sequences)
        request_id = random_id("cmpl")
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
                text, logprobs = self._choice_body(request, output, completion, with_prompt=request.echo)
                choices.append(
                    CompletionChoice(
                        index=i * request.n + completion.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                )
        return CompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=usage(num_prompt_tokens, num_completion_tokens)
        )

    def _choice_body(
        self,
        request: CompletionRequest,
        output: RequestOutput,
        completion: CompletionOutput,
        with_prompt: bool,
        text_offset: int = 0,
    ) -> tuple[str, CompletionLogprobs | None]:
        """A choice's text (or the part of it new in a stream chunk) and its logprobs."""
        text = completion.text
        logprobs = CompletionLogprobs() if request.logprobs is not None else None
        if with_prompt:
            text = self._prompt_text(output) + text
            if logprobs is not None:
                rows = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
                text_offset = self._add_logprobs(logprobs, output.prompt_token_ids, rows, text_offset)
        if logprobs is not None:
            self._add_logprobs(logprobs, completion.token_ids, completion.logprobs or [], text_offset)
        return text, logprobs

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids)

    def _add_logprobs(
        self,
        logprobs: CompletionLogprobs,
        token_ids: list[int],
        rows: Sequence[PositionLogprobs | None],
        text_offset: int,
    ) -> int:
        """Append one entry per token; returns the text offset after the last one."""
        for token_id, row in zip(token_ids, rows):
            actual = row.get(token_id) if row else None
            token = actual.decoded_token if actual is not None and actual.decoded_token is not None else None
            token = token if token is not None else self.decode_token(token_id)
            logprobs.tokens.append(token)
            logprobs.text_offset.append(text_offset)
            text_offset += len(token)
            logprobs.token_logprobs.append(clamp_logprob(actual.logprob) if actual is not None else None)
            logprobs.top_logprobs.append(
                {
                    (lp.decoded_token if lp.decoded_token is not None else self.decode_token(tid)): clamp_logprob(
                        lp.logprob
                    )
                    for tid, lp in row.items()
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
        echoed = [False] * num_choices
        num_prompt_tokens = sum(len(token_ids) for _, token_ids in prompts)
        num_completion_tokens = 0
        options = request.stream_options
        streams = self._generate_all(request, request_id, prompts, params, OutputKind.DELTA)
        async for i, output in self.bounded(merge_streams(streams), deadline):
            for completion in output.outputs:
                completion = _scored(completion) if request.max_tokens == 0 else completion
                index = i * request.n + completion.index
                num_completion_tokens += len(completion.token_ids)
                with_prompt = request.echo and not echoed[index]
                echoed[index] = True
                text, logprobs = self._choice_body(request, output, completion, with_prompt, text_offsets[index])
                if logprobs is not None and logprobs.tokens:
                    text_offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                if not text and completion.finish_reason is None and not (logprobs and logprobs.tokens):
                    continue  # nothing new to say yet (text held back for a possible stop string)
                choice = CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
                chunk_usage = None
                if options is not None and options.continuous_usage_stats:
                    chunk_usage = usage(num_prompt_tokens, num_completion_tokens)
                chunk = CompletionResponse(
                    id=request_id, created=created, model=self.model_name, choices=[choice], usage=chunk_usage
                )
                yield sse_event(chunk)
        if options is not None and options.include_usage:
            final = CompletionResponse(
                id=request_id,
                created=created,
                model=self.model_name,
                choices=[],
                usage=usage(num_prompt_tokens, num_completion_tokens),
            )
            yield sse_event(final)


def _scored(completion: CompletionOutput) -> CompletionOutput:
    """A completion of a scoring request (max_tokens 0): what it generated is dropped."""
    return CompletionOutput(
        index=completion.index,
        text="",
        token_ids=[],
        logprobs=[] if completion.logprobs is not None else None,
        finish_reason="length" if completion.finish_reason is not None else None,
    )
