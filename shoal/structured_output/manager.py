"""`StructuredOutputManager`: the engine core's side of structured output, behind one seam.

It compiles each request's grammar on a thread of its own (a slow schema never stalls the
engine loop: the request is kept here, out of the scheduler's queue, until its grammar is
ready), caches what it compiled by spec, keeps one `Matcher` per request, advances it by the
tokens the engine accepts, and fills the token bitmask of a step's structured rows on the host.

The scheduler hands it its requests with a grammar (`add_request`, `take_compiled`,
`remove_request`), asks it which rows of a step it builds are structured (`sampling_rows`) and
tells it the tokens each step accepted (`accept_outputs`). The bitmask of a step
(`grammar_bitmask`) is asked for by the scheduler, as it builds a step that carries it, or by
the engine core, once a step whose bitmask follows its launch may have it.

A matcher only ever holds accepted tokens — the request's output so far (after its reasoning,
for a reasoning model). Nothing speculative enters it: with async scheduling the bitmask of a
step that ran ahead is filled once the step before it has landed (see `EngineCore`), and a
preempted request keeps its output tokens, so its matcher stays where it is while the KV cache
is recomputed.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from shoal.step import GrammarBitmask
from shoal.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from shoal.config import ModelConfig
    from shoal.engine_core.request import Request
    from shoal.protocol import EngineCoreOutput
    from shoal.structured_output.grammar import GrammarCompiler, Matcher

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse (n > 1, repeated schemas, tool calls of one tool set).
_CACHE_SIZE = 256


class StructuredRequest:
    """A request's grammar: being compiled, then a matcher (or the error that stopped it)."""

    def __init__(self, params: StructuredOutputsParams, compiled: Future, stop_token_ids: list[int]) -> None:
        self.params = params
        self.compiled = compiled
        self.stop_token_ids = stop_token_ids
        self.matcher: Matcher | None = None
        self.error: str | None = None
        # A reasoning model's output is free while it thinks: from the start where the prompt
        # opened the thinking, or from a first token that opens it; until the end tokens.
        self.reasoning_end = params.reasoning_end_token_ids or None
        self.reasoning_start = params.reasoning_start_token_id if self.reasoning_end else None
        self.in_reasoning = self.reasoning_end is not None and self.reasoning_start is None
        self._recent: list[int] = []  # the last tokens, to find a reasoning end split over steps

    @property
    def ready(self) -> bool:
        return self.matcher is not None or self.error is not None

    @property
    def constrains_next_token(self) -> bool:
        return self.matcher is not None and not self.in_reasoning

    def start(self) -> bool:
        """Make the matcher once the grammar is compiled; True once ready (or failed)."""
        if self.ready:
            return True
        if not self.compiled.done():
            return False
        from shoal.structured_output.grammar import Matcher

        try:
            self.matcher = Matcher(self.compiled.result(), self.stop_token_ids)
        except ValueError as exc:
            self.error = str(exc)
            return True
        if self.reasoning_start is not None:  # the first token: the grammar's, or the think-start
            self.matcher.also_allowed = (self.reasoning_start,)
        return True

    def accept(self, token_ids: list[int]) -> bool:
        """Advance by accepted tokens; False when the grammar refused one (the mask was not
        applied as it should have been: a bug, reported by the caller)."""
        assert self.matcher is not None
        for token_id in token_ids:
            if self.matcher.also_allowed:  # the first token decides whether the model thinks
                self.matcher.also_allowed = ()
                if token_id == self.reasoning_start:
                    self.in_reasoning = True
                    continue
            if self.in_reasoning:
                self._watch_reasoning_end(token_id)
            elif not self.matcher.accept(token_id):
                return False
        return True

    def _watch_reasoning_end(self, token_id: int) -> None:
        assert self.reasoning_end is not None
        self._recent = [*self._recent, token_id][-len(self.reasoning_end) :]
        if self._recent == self.reasoning_end:
            self.in_reasoning = False


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self.num_words = -(-self.vocab_size // 32)
        self._executor: ThreadPoolExecutor | None = None
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        # The unfinished requests with a grammar, by id (empty: the scheduler skips every
        # structured-output path), and those whose grammar is still being compiled.
        self.requests: dict[str, Request] = {}
        self.compiling: list[Request] = []

    # ---- the scheduler's requests with a grammar -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar (or reuse a cached one); the request stays here
        until `take_compiled` hands it back."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        stop_token_ids = list(request.sampling_params.stop_token_ids)
        if request.eos_token_id is not None:
            stop_token_ids.append(request.eos_token_id)
        request.structured_output = StructuredRequest(params, self._compiled(params), stop_token_ids)
        self.requests[request.request_id] = request
        self.compiling.append(request)

    def take_compiled(self) -> tuple[list[Request], list[Request]]:
        """The requests whose grammar is now compiled, with a matcher (they may be scheduled),
        and those whose grammar failed (`structured_output.error` says why); both leave
        `compiling`."""
        ready, failed, still_compiling = [], [], []
        for request in self.compiling:
            grammar = request.structured_output
            assert grammar is not None
            if not grammar.start():
                still_compiling.append(request)
            elif grammar.error is None:
                ready.append(request)
            else:
                logger.error("request %s: its grammar did not compile: %s", request.request_id, grammar.error)
                failed.append(request)
        self.compiling = still_compiling
        return ready, failed

    def remove_request(self, request: Request) -> None:
        """The request is finished (or aborted, perhaps while its grammar was compiling)."""
        del self.requests[request.request_id]
        if self.compiling and request in self.compiling:
            self.compiling.remove(request)

    @staticmethod
    def sampling_rows(requests: dict[str, Request]) -> list[str]:
        """The ids of a step's `requests` (in batch order) that have a grammar and sample a
        token in it (their prompt, or the chunk of it, is complete): its structured rows."""
        return [
            request_id
            for request_id, request in requests.items()
            if request.structured_output is not None and request.num_computed_tokens >= request.num_tokens
        ]

    def accept_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Feed the tokens a step accepted to the unfinished requests' grammars."""
        for output in outputs:
            request = self.requests.get(output.request_id)
            grammar = request.structured_output if request is not None else None
            if grammar is None or grammar.matcher is None:
                continue
            if not grammar.accept(output.new_token_ids):
                logger.error(
                    "request %s: its grammar refused a sampled token %s", output.request_id, output.new_token_ids
                )

    # ---- compiling, off the engine loop --------------------------------------------------------

    def _compiled(self, params: StructuredOutputsParams) -> Future:
        key = params.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="shoal-grammar")
        future = self._executor.submit(self._compile, params)
        self._cache[key] = future
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> Any:
        return self._grammar_compiler().compile(params)

    def _grammar_compiler(self) -> GrammarCompiler:
        """Built on first use, in the compile thread: the tokenizer loads there."""
        with self._compiler_lock:
            if self._compiler is None:
                from shoal.frontend.tokenizer import get_tokenizer
                from shoal.structured_output.grammar import GrammarCompiler

                tokenizer = get_tokenizer(self.model_config.tokenizer)
                if tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer, and this model has none")
                self._compiler = GrammarCompiler(tokenizer, self.vocab_size)
            return self._compiler

    @staticmethod
    def wait_for_any(requests: list[Request], timeout_s: float) -> None:
        """Block until one of `requests`' grammars is compiled, or `timeout_s` has passed (the
        engine has nothing else to do)."""
        futures = [r.structured_output.compiled for r in requests if r.structured_output is not None]
        wait(futures, timeout=timeout_s, return_when="FIRST_COMPLETED")

    # ---- every step, on the host -------------------------------------------------------------

    def grammar_bitmask(
        self, req_ids: list[str], spec_tokens: dict[str, list[int]] | None = None
    ) -> GrammarBitmask | None:
        """The bitmask of a step's structured rows (`SchedulerOutput.structured_req_ids`): one
        row per request still unfinished whose grammar constrains the token it samples, filled
        from its matcher, which has seen every token before that one; None when no row is
        constrained. A request with draft tokens (`spec_tokens`, speculative decoding) has one
        row per verification row: row j as if drafts 0..j-1 were accepted (its id repeated)."""
        if spec_tokens and any(spec_tokens.get(r) for r in req_ids):
            return self._bitmask_with_drafts(self.requests_of(req_ids), spec_tokens)
        filled = self.fill_bitmask(self.requests_of(req_ids))
        if filled is None:
            return None
        req_ids, bitmask = filled
        return GrammarBitmask(req_ids=req_ids, bitmask=bitmask.tobytes(), num_words=bitmask.shape[1])

    def _bitmask_with_drafts(self, requests: list[Request], spec_tokens: dict[str, list[int]]) -> GrammarBitmask | None:
        """Each constrained request's rows over its drafts (which its grammar accepts: the
        scheduler cut them with `accepted_prefix`), the matcher rolled back after."""
        constrained = [
            r for r in requests if r.structured_output is not None and r.structured_output.constrains_next_token
        ]
        if not constrained:
            return None
        num_rows = sum(1 + len(spec_tokens.get(r.request_id, [])) for r in constrained)
        bitmask = np.empty((num_rows, self.num_words), dtype=np.int32)
        row_req_ids: list[str] = []
        for request in constrained:
            matcher = request.structured_output.matcher  # type: ignore[union-attr]
            assert matcher is not None
            drafts = spec_tokens.get(request.request_id, [])
            matcher.fill(bitmask, len(row_req_ids))
            row_req_ids.append(request.request_id)
            for token_id in drafts:
                matcher.accept(token_id)
                matcher.fill(bitmask, len(row_req_ids))
                row_req_ids.append(request.request_id)
            if drafts:
                matcher.rollback(len(drafts))
        return GrammarBitmask(req_ids=row_req_ids, bitmask=bitmask.tobytes(), num_words=self.num_words)

    @staticmethod
    def accepted_prefix(request: Request, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the request's grammar refuses (none while its
        grammar does not constrain the next token plainly: compiling, reasoning, or a first
        token that may open a thought); the matcher is left as it was."""
        grammar = request.structured_output
        if grammar is None or not grammar.constrains_next_token or grammar.matcher is None:
            return []
        matcher = grammar.matcher
        if matcher.also_allowed:
            return []
        num_accepted = 0
        for token_id in drafts:
            if not matcher.accept(token_id):
                break
            num_accepted += 1
        if num_accepted:
            matcher.rollback(num_accepted)
        return drafts[:num_accepted]

    def requests_of(self, req_ids: list[str]) -> list[Request]:
        """The unfinished requests among `req_ids`, in that order."""
        return [self.requests[r] for r in req_ids if r in self.requests]

    def fill_bitmask(self, requests: list[Request]) -> tuple[list[str], np.ndarray] | None:
        """The bitmask rows of the requests whose next token their grammar constrains (in the
        given order), or None when none is."""
        constrained = [
            r for r in requests if r.structured_output is not None and r.structured_output.constrains_next_token
        ]
        if not constrained:
            return None
        from shoal.structured_output.grammar import fill_rows

        bitmask = np.empty((len(constrained), self.num_words), dtype=np.int32)
        fill_rows([r.structured_output.matcher for r in constrained], bitmask)  # type: ignore[union-attr,misc]
        return [r.request_id for r in constrained], bitmask

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
