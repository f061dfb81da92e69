"""`InputProcessor`: validates and tokenizes a prompt into an `EngineCoreRequest`.

Everything a user can get wrong is caught here, before anything reaches the engine core, and
raised as `ValueError` with a message that says what to change.
"""

from __future__ import annotations

import time
from typing import Any

from shoal.config import ModelConfig
from shoal.frontend.tokenizer import generation_eos_token_ids
from shoal.protocol import EngineCoreRequest
from shoal.sampling_params import SamplingParams

# A prompt: text, {"prompt": text} or {"prompt_token_ids": [...]}, or a list of token ids.
PromptType = str | dict[str, Any] | list[int]


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.speculates = False  # set from the engine's config (speculative decoding on)
        self.eos_token_id: int | None = tokenizer.eos_token_id if tokenizer is not None else None
        extra = [t for t in generation_eos_token_ids(model_config.model) if t != self.eos_token_id]
        self.extra_eos_token_ids = extra
        if self.eos_token_id is None and extra:
            self.eos_token_id = extra.pop(0)

    def stop_token_ids(self) -> list[int]:
        """The tokens that end a generation unless `ignore_eos`: the eos and the model's
        other end-of-sequence tokens (generation_config.json)."""
        eos = [] if self.eos_token_id is None else [self.eos_token_id]
        return eos + self.extra_eos_token_ids

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text (if it has one) and its token ids."""
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self._encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompt token ids")
        return list(self.tokenizer.encode(text))

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> EngineCoreRequest:
        self.validate_prompt(prompt_token_ids)
        self.validate_params(params)
        room = self.model_config.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if not params.ignore_eos and self.extra_eos_token_ids:
            params = params.clone(stop_token_ids=sorted(set(params.stop_token_ids) | set(self.extra_eos_token_ids)))
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            max_tokens=max_tokens,
            lora_name=lora_name,
        )

    def validate_params(self, params: SamplingParams) -> None:
        """What only the model can tell about sampling parameters: the token ids of logit_bias
        and allowed_token_ids in its vocabulary, a structured-output spec its grammar library
        can build (cached: checking the same spec again costs nothing)."""
        vocab_size = self.model_config.vocab_size
        bad_stop = next((t for t in params.stop_token_ids if t >= vocab_size), None)
        if bad_stop is not None:
            raise ValueError(f"SamplingParams.stop_token_ids id {bad_stop} is out of the vocabulary [0, {vocab_size})")
        for name, token_ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
            bad = next((t for t in token_ids or () if t >= vocab_size), None)
            if bad is not None:
                raise ValueError(f"SamplingParams.{name} token id {bad} is out of the vocabulary [0, {vocab_size})")
        if params.return_routed_experts:
            from shoal.layers.moe.routing import num_routed_experts

            if num_routed_experts(self.model_config.hf_config) == 0:
                raise ValueError(
                    "SamplingParams.return_routed_experts needs a mixture-of-experts model, and this one has none"
                )
            if self.speculates:  # the verified drafts' routing is not yet told from the accepted tokens'
                raise ValueError("SamplingParams.return_routed_experts does not run with speculative decoding yet")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer, and this model has none")
            from shoal.structured_output.grammar import validate

            validate(params.structured_outputs)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        max_model_len = self.model_config.max_model_len
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens, but max_model_len is {max_model_len}: "
                "no room is left to generate"
            )
        vocab_size = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is out of the vocabulary [0, {vocab_size})")
