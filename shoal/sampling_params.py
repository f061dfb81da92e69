"""`SamplingParams`: how one request is decoded, with the field names vLLM users know.

It is a `msgspec.Struct` so that it crosses the frontend → engine-core boundary without pickle.
Every value is checked in `__post_init__`; a bad one raises `ValueError` naming the field.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.structured_output.params import StructuredOutputsParams

__all__ = ["MAX_BEAM_WIDTH", "MAX_LOGPROBS", "BeamSearchParams", "SamplingParams", "StructuredOutputsParams"]

# Below this temperature sampling is greedy (argmax).
_GREEDY_EPS = 1e-5
# The most logprobs a request may ask for per position.
MAX_LOGPROBS = 20
# The range of a logit_bias value (OpenAI's).
MAX_LOGIT_BIAS = 100.0
# Seeds are signed 64-bit integers (as OpenAI's and vLLM's); torch's generators take them as
# their unsigned two's complement, so each seed gives its own deterministic stream.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Decoding parameters of one request.

    Logprobs (`logprobs`, `prompt_logprobs`) are computed from the raw logits of the model,
    before temperature, penalties or top-k/top-p/min-p are applied (the convention of vLLM V1).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # Token id -> a value added to its logit before sampling, in [-100, 100] (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM's allowed_token_ids); None: any.
    allowed_token_ids: list[int] | None = None
    # The output must match a JSON schema, regex, choice or grammar (vLLM's structured outputs).
    structured_outputs: StructuredOutputsParams | None = None
    # Mixture-of-experts models: return the experts each position was routed to in each layer
    # (`CompletionOutput.routed_experts`; SGLang's `return_routed_experts`). Such a request
    # computes its whole prompt (no prefix-cache hit), as a request for prompt logprobs does.
    return_routed_experts: bool = False
    # What extensions read (vLLM's name): "kv_transfer_params", set by the prefill/decode proxy
    # (shoal/kv_transfer/params.py), is the only key shoal reads.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.logit_bias is not None:
            self.logit_bias = {int(token_id): float(bias) for token_id, bias in self.logit_bias.items()} or None
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        if self.extra_args:
            from shoal.kv_transfer.params import transfer_params

            transfer_params(self.extra_args)  # a malformed one is refused here, not in the engine
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(0 <= value <= MAX_LOGPROBS, name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        _check(all(s for s in self.stop), "stop", "must not contain empty strings")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0")
        if self.seed is not None:
            _check(MIN_SEED <= self.seed <= MAX_SEED, "seed", f"must be a signed 64-bit integer, got {self.seed}")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", "must not be empty (None allows every token)")
            _check(all(t >= 0 for t in self.allowed_token_ids), "allowed_token_ids", "must be >= 0")
        if self.logit_bias is not None:
            _check(all(t >= 0 for t in self.logit_bias), "logit_bias", "token ids must be >= 0")
            bad = next((b for b in self.logit_bias.values() if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS), None)
            _check(bad is None, "logit_bias", f"values must be in [-100, 100], got {bad}")
        if self.structured_outputs is not None:
            # Past the end of its grammar only eos (or a stop token) may follow: ignoring eos, or
            # forbidding it before min_tokens, would leave no token to sample.
            _check(not self.ignore_eos, "ignore_eos", "cannot be combined with structured_outputs")
            _check(self.min_tokens == 0, "min_tokens", "cannot be combined with structured_outputs")
            # Two masks whose intersection may be empty would leave nothing to sample.
            _check(self.allowed_token_ids is None, "allowed_token_ids", "cannot be combined with structured_outputs")

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling depends on the tokens generated so far (and the prompt)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return msgspec.structs.replace(self, **changes)


def offset_seed(seed: int, offset: int) -> int:
    """`seed + offset`, wrapped around the signed 64-bit range (completion i of n uses seed + i)."""
    return (seed + offset - MIN_SEED) % 2**64 + MIN_SEED


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {message}")


# Each beam asks the engine for its 2 * beam_width most likely next tokens.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


class BeamSearchParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How `LLM.beam_search` searches (vLLM's names; shoal/frontend/beam_search.py).

    `beam_width` beams are kept and returned; a finished beam scores `cum_logprob /
    num_tokens ** length_penalty` (its generated tokens, eos included, as transformers counts
    them). `temperature` is accepted as vLLM accepts it: the candidates' logprobs come from the
    raw logits, so it does not change the search."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"BeamSearchParams.beam_width must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"BeamSearchParams.temperature must be >= 0, got {self.temperature}")
        if self.length_penalty != self.length_penalty or abs(self.length_penalty) == float("inf"):
            raise ValueError(f"BeamSearchParams.length_penalty must be a finite number, got {self.length_penalty}")
