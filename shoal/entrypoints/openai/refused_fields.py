"""The request fields of vLLM's (and OpenAI's) generation routes that shoal does not implement.

Each is declared, so that a client that sends one gets what it asked for or a 400 naming it,
never a 200 that ignored it: the values that ask for nothing (null, and what vLLM defaults the
field to) are taken, anything else is refused. The schema lists the values taken (`enum`).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, WithJsonSchema, create_model

# name -> (what shoal does not do, the values besides null that ask for nothing)
_SAMPLING: dict[str, tuple[str, tuple[Any, ...]]] = {
    "bad_words": ("banned word sequences", ([],)),
    "logprob_token_ids": ("logprobs of chosen token ids (use logprobs / top_logprobs)", ([],)),
    "logits_processors": ("custom logits processors", ([],)),
    "guided_whitespace_pattern": ("a custom JSON whitespace pattern (see disable_any_whitespace)", ()),
    "priority": ("priority scheduling (requests are served first come, first served)", (0,)),
    "cache_salt": ("salted prefix caching", ()),
    "kv_transfer_params": ("disaggregated prefill (KV transfer)", ({},)),
    "ec_transfer_params": ("disaggregated encoder caches", ({},)),
    "vllm_xargs": ("vLLM's custom extension arguments", ({},)),
    "repetition_detection": ("stopping on repeated n-grams", ()),
    "thinking_token_budget": ("a budget of thinking tokens", (-1,)),
    "return_token_offsets": ("character offsets of tokens (vLLM's render routes)", (False,)),
    "mm_processor_kwargs": ("multimodal inputs (shoal's models read text)", ({},)),
}
_COMPLETION: dict[str, tuple[str, tuple[Any, ...]]] = {
    "suffix": ("text after the completion (insertion)", ()),
    "prompt_embeds": ("prompts as embeddings (send text or token ids)", ([],)),
}
_CHAT: dict[str, tuple[str, tuple[Any, ...]]] = {
    "structural_tag": ("structural tags (use response_format, structured_outputs or tools)", ()),
    "functions": ("the deprecated functions field (use tools)", ([],)),
    "function_call": ("the deprecated function_call field (use tool_choice)", ("none",)),
    "audio": ("audio output", ()),
    "modalities": ("output other than text", (["text"],)),
    "web_search_options": ("web search", ()),
    "verbosity": ("a verbosity setting", ()),
    "media_io_kwargs": ("multimodal inputs (shoal's models read text)", ({},)),
    "max_repetition_pattern_size": ("stopping on repeated patterns", (0,)),
    "min_repetition_pattern_size": ("stopping on repeated patterns", (0,)),
    "repetition_min_count": ("stopping on repeated patterns", (0,)),
}


def _same(value: Any, accepted: Any) -> bool:
    """JSON equality: `true` is not `1`, `1.0` is `1`."""
    return isinstance(value, bool) == isinstance(accepted, bool) and value == accepted


def refused(why: str, *accepted: Any) -> Any:
    """The type of a field shoal refuses unless it is null or one of `accepted`; `why` ends
    the 400's message (`<field>: not supported by shoal: <why>`)."""

    def check(value: Any) -> Any:
        if value is None or any(_same(value, a) for a in accepted):
            return value
        raise ValueError(f"not supported by shoal: {why}")

    schema = {"enum": [None, *accepted], "description": f"Not supported: {why}"}
    return Annotated[Any, BeforeValidator(check), WithJsonSchema(schema)]


class _Refused(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def _fields(table: dict[str, tuple[str, tuple[Any, ...]]]) -> dict[str, Any]:
    return {name: (refused(why, *accepted), None) for name, (why, accepted) in table.items()}


# Mixed into the request models of protocol.py.
RefusedSamplingFields: type[BaseModel] = create_model("RefusedSamplingFields", __base__=_Refused, **_fields(_SAMPLING))
RefusedCompletionFields: type[BaseModel] = create_model(
    "RefusedCompletionFields", __base__=_Refused, **_fields(_COMPLETION)
)
RefusedChatFields: type[BaseModel] = create_model("RefusedChatFields", __base__=_Refused, **_fields(_CHAT))


def refused_fields() -> dict[str, str]:
    """Every refused field and why (for the docs and tests)."""
    return {name: why for table in (_SAMPLING, _COMPLETION, _CHAT) for name, (why, _) in table.items()}
