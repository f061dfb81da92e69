"""Incremental detokenization and stop strings.

Text is produced token by token. A fast tokenizer uses the `tokenizers` library's
`DecodeStream`, which holds back bytes until they form whole UTF-8 characters and gets
SentencePiece/BPE spacing right by decoding each token in the context of the ones before it.
Other tokenizers decode the whole output again each step and emit the new, complete suffix.

Stop strings are searched only in the newly added text (plus enough of the old to catch one
that straddles the boundary). Text that could still turn into a stop string is held back from
streamed deltas until it cannot.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from shoal.sampling_params import SamplingParams

# Prompt tokens given to DecodeStream as context for the first generated token's spacing.
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""
        self._stop = params.stop
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._num_sent_chars = 0
        self._stream = _make_stream(tokenizer, prompt_token_ids, params.skip_special_tokens)
        # The slow-tokenizer path: the last prompt tokens (for the spacing of the first output
        # token) and every output token, and the whole decoded text of those.
        self._token_ids: list[int] = []
        self._decoded = ""
        # The fast path's tokens whose bytes DecodeStream holds back (no whole character yet).
        self._held: list[int] = []
        # Of the last update's tokens, how many came after the one that completed a stop string
        # (speculative decoding delivers several tokens at once; they are dropped, as if the
        # request had stopped token by token).
        self.num_tokens_after_stop = 0
        if self._stream is None:
            self._token_ids = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
            self._decoded = self._decode(self._token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool, finished: bool = False) -> str | None:
        """Add new tokens' text; return the stop string that ended the text, if one did.

        `stop_terminated`: the last token is an eos or stop token; its text is left out unless
        `include_stop_str_in_output` (as vLLM does). `finished`: the last update of the request,
        which also gives the whole characters still held back; the bytes of a character the
        output ends inside (`max_tokens` cut it) are dropped, as they were held back from the
        stream, rather than written as U+FFFD the way a whole decode does (vLLM drops them too).
        """
        self.num_tokens_after_stop = 0
        if not self.params.detokenize:
            return None
        num_new_tokens = len(new_token_ids)
        if stop_terminated and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        if self._stop and len(new_token_ids) > 1:
            for i, token_id in enumerate(new_token_ids):
                old_len = len(self.output_text)
                self.output_text += self._decode_next(token_id)
                stop = self._find_stop(old_len)
                if stop is not None:
                    self.num_tokens_after_stop = num_new_tokens - 1 - i
                    return stop
            new_token_ids = []
        old_len = len(self.output_text)
        for token_id in new_token_ids:
            self.output_text += self._decode_next(token_id)
        if finished:
            self.output_text += self._held_text()
        return self._find_stop(old_len)

    def _decode_next(self, token_id: int) -> str:
        if self._stream is not None:
            text = self._stream.step(self.tokenizer._tokenizer, token_id)
            if text is None:
                self._held.append(token_id)
            elif self._held:
                self._held.clear()
            return text or ""
        self._token_ids.append(token_id)
        text = self._decode(self._token_ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        delta, self._decoded = text[len(self._decoded) :], text
        return delta

    def _held_text(self) -> str:
        if self._stream is not None:
            text = self._decode(self._held) if self._held else ""
        else:
            text = self._decode(self._token_ids)[len(self._decoded) :]
        return text.rstrip("\ufffd")  # what a decode writes for a character's first bytes alone

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:  # a model folder without a tokenizer: token ids only
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.params.skip_special_tokens)

    def _find_stop(self, old_len: int) -> str | None:
        if not self._stop:
            return None
        search_from = max(0, old_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self.output_text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop

    def text_delta(self, finished: bool) -> str:
        """Text not yet streamed, holding back a tail that might still become a stop string."""
        end = len(self.output_text)
        if not finished and self._max_stop_len and not self.params.include_stop_str_in_output:
            end = max(self._num_sent_chars, end - self._max_stop_len + 1)
        delta = self.output_text[self._num_sent_chars : end]
        self._num_sent_chars = end
        return delta


def _make_stream(tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> DecodeStream | None:
    if getattr(tokenizer, "_tokenizer", None) is None:
        return None  # not a fast tokenizer: decode the whole output each step
    context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
    try:
        return DecodeStream(context, skip_special_tokens=skip_special_tokens)
    except TypeError:  # tokenizers before 0.22 take no prompt context
        return DecodeStream(skip_special_tokens=skip_special_tokens)
