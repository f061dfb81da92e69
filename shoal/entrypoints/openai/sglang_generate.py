"""SGLang's /generate in shoal's terms: the request (`GenerateReqInput` of SGLang's
python/sglang/srt/managers/io_struct.py, its sampling parameters by SGLang's names) as the
prompts and `SamplingParams` of shoal's engine requests, and a finished or running request as
SGLang's answer (`text`, `output_ids`, `meta_info`, as SGLang's tokenizer manager builds it).

A request is one prompt (`text` a string, `input_ids` a list of ids) or a batch (a list of
either); each prompt with `n` samples is `n` engine requests, in SGLang's order (prompt by
prompt, its samples in turn). What shoal cannot do is refused by name (a ValueError, a 400)
rather than ignored: images, LoRA, input embeddings, custom logit processors.
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass
from typing import Any

from shoal.entrypoints.openai.serving import clamp_logprob
from shoal.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from shoal.sampling_params import SamplingParams
from shoal.structured_output.params import StructuredOutputsParams

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default

# SGLang's sampling parameter → shoal's `SamplingParams` field, where only the name differs.
_RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
}
_SAME = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "n",
    "logit_bias",
)
# Structured output, by SGLang's names.
_STRUCTURED = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}
# Sampling parameters SGLang has that shoal honours only at their default.
_DEFAULT_ONLY: dict[str, Any] = {"stop_regex": None, "custom_params": None, "stream_interval": None}

# Top-level fields: read (below), accepted and ignored (routing and logging hints), or refused
# unless at their default (what shoal does not have).
_READ = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "return_routed_experts",
    "routed_experts_start_len",
    "stream",
}
_IGNORED = {
    "log_metrics",
    "priority",
    "routing_key",
    "routed_dp_rank",
    "data_parallel_rank",
    "session_id",
    "conversation_id",
    "custom_labels",
    "no_logs",
    "extra_key",
    "cache_salt",
    "modalities",
}
_REFUSED: dict[str, tuple[Any, str]] = {
    "image_data": (None, "this engine takes text only"),
    "video_data": (None, "this engine takes text only"),
    "audio_data": (None, "this engine takes text only"),
    "input_embeds": (None, "give text or input_ids"),
    "lora_path": (None, "LoRA adapters are not supported"),
    "custom_logit_processor": (None, "custom logit processors are not supported"),
    "token_ids_logprob": (None, "logprobs of chosen token ids are not supported"),
    "return_hidden_states": (False, "hidden states are not returned"),
    "session_params": (None, "sessions are not supported"),
    "bootstrap_host": (None, "P/D disaggregation is not supported"),
    "bootstrap_room": (None, "P/D disaggregation is not supported"),
}


@dataclass(frozen=True)
class SampleRequest:
    """One engine request of a /generate call: the prompt of item `index` and its sample."""

    index: int  # the answer's position (SGLang's batch order)
    rid: str  # the id the answer carries (meta_info.id), and that /abort_request names
    prompt: str | list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    # meta_info.routed_experts: the experts of positions from `routed_experts_start_len` on.
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0


@dataclass(frozen=True)
class GenerateCall:
    samples: list[SampleRequest]
    is_single: bool  # one prompt, one sample: the answer is an object, not a list
    stream: bool


def parse_generate(body: Any) -> GenerateCall:
    """The engine requests of a /generate body; ValueError for anything wrong or unsupported."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    _check_fields(body)
    prompts, batched = _prompts(body)
    item_params = _per_item(body.get("sampling_params"), len(prompts), "sampling_params", dict, {})
    n = _sample_count(item_params)
    rids = _rids(body.get("rid"), len(prompts), n, batched)
    samples = []
    for i, prompt in enumerate(prompts):
        return_logprob = _per_item(body.get("return_logprob"), len(prompts), "return_logprob", bool, False)[i]
        start = _per_item(body.get("logprob_start_len"), len(prompts), "logprob_start_len", int, -1)[i]
        top = _per_item(body.get("top_logprobs_num"), len(prompts), "top_logprobs_num", int, 0)[i]
        routed = _per_item(body.get("return_routed_experts"), len(prompts), "return_routed_experts", bool, False)[i]
        routed_start = _per_item(
            body.get("routed_experts_start_len"), len(prompts), "routed_experts_start_len", int, 0
        )[i]
        if routed_start < 0:
            raise ValueError(f"routed_experts_start_len must be >= 0, got {routed_start}")
        for j in range(n):
            params = sampling_params(item_params[i], return_logprob, start, top, sample_index=j)
            if routed:
                params = params.clone(return_routed_experts=True)
            samples.append(
                SampleRequest(
                    index=i * n + j,
                    rid=rids[i * n + j],
                    prompt=prompt,
                    params=params,
                    return_logprob=return_logprob,
                    logprob_start_len=start,
                    top_logprobs_num=top,
                    return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                    return_routed_experts=routed,
                    routed_experts_start_len=routed_start,
                )
            )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ValueError(f"stream must be true or false, got {stream!r}")
    return GenerateCall(samples, is_single=not batched and n == 1, stream=stream)


def _check_fields(body: dict[str, Any]) -> None:
    for key, value in body.items():
        if key in _READ or key in _IGNORED:
            continue
        if key in _REFUSED:
            default, why = _REFUSED[key]
            if value not in (default, None, [], {}):
                raise ValueError(f"{key} is not supported: {why}")
            continue
        raise ValueError(f"unknown field {key!r} in a /generate request")


def _prompts(body: dict[str, Any]) -> tuple[list[str | list[int]], bool]:
    """The prompts, and whether the request is a batch."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("give exactly one of text and input_ids")
    if text is not None:
        if isinstance(text, str):
            return [text], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), True
        raise ValueError("text must be a string or a non-empty list of strings")
    if isinstance(input_ids, list) and input_ids and all(_is_token_id(t) for t in input_ids):
        return [list(input_ids)], False
    if (
        isinstance(input_ids, list)
        and input_ids
        and all(isinstance(ids, list) and ids and all(_is_token_id(t) for t in ids) for ids in input_ids)
    ):
        return [list(ids) for ids in input_ids], True
    raise ValueError("input_ids must be a non-empty list of token ids or a list of such lists")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _per_item(value: Any, num_items: int, name: str, kind: type, default: Any) -> list[Any]:
    """A field given once for every prompt, or as a list of one value per prompt."""
    if value is None:
        return [default] * num_items
    if isinstance(value, list) and kind is not list:
        if len(value) != num_items:
            raise ValueError(f"{name} has {len(value)} values for {num_items} prompts")
        values = [default if v is None else v for v in value]
    else:
        values = [value] * num_items
    for v in values:
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise ValueError(f"{name} must be a {kind.__name__} (or a list of one per prompt), got {v!r}")
    return values


def _sample_count(item_params: list[dict[str, Any]]) -> int:
    counts = {params.get("n") or 1 for params in item_params}
    if len(counts) != 1:
        raise ValueError("every prompt of a batch must ask for the same n")
    (n,) = counts
    if not _is_token_id(n) or n < 1:
        raise ValueError(f"sampling_params.n must be a positive integer, got {n!r}")
    return n


def _rids(rid: Any, num_prompts: int, n: int, batched: bool) -> list[str]:
    """Each sample's id: SGLang's (the given id, `{rid}_{i}` in a batch, one id per prompt
    with its samples numbered), else fresh ones."""
    count = num_prompts * n
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        return [rid] if count == 1 else [f"{rid}_{i}" for i in range(count)]
    if isinstance(rid, list) and len(rid) == num_prompts and all(isinstance(r, str) for r in rid):
        return [r if n == 1 else f"{r}_{j}" for r in rid for j in range(n)]
    raise ValueError(f"rid must be a string or a list of one string per prompt ({num_prompts})")


def sampling_params(
    sglang: dict[str, Any], return_logprob: bool, logprob_start_len: int, top_logprobs_num: int, sample_index: int = 0
) -> SamplingParams:
    """SGLang's sampling parameters as shoal's, for one sample (its seed offset by its index,
    as shoal offsets the seeds of a request's `n` completions)."""
    fields: dict[str, Any] = {"max_tokens": DEFAULT_MAX_NEW_TOKENS}
    structured: dict[str, Any] = {}
    for key, value in sglang.items():
        if value is None or key == "n":
            continue
        if key in _RENAMED:
            fields[_RENAMED[key]] = value
        elif key in _SAME:
            fields[key] = value
        elif key == "no_stop_trim":
            fields["include_stop_str_in_output"] = bool(value)
        elif key in _STRUCTURED:
            structured[_STRUCTURED[key]] = json.loads(value) if key == "json_schema" else value
        elif key in _DEFAULT_ONLY:
            if value != _DEFAULT_ONLY[key]:
                raise ValueError(f"sampling_params.{key} is not supported")
        else:
            raise ValueError(f"unknown sampling parameter {key!r}")
    if fields.get("seed") is not None and sample_index:
        fields["seed"] = int(fields["seed"]) + sample_index
    if structured:
        fields["structured_outputs"] = StructuredOutputsParams(**structured)
    if fields.get("max_tokens") == 0:
        raise ValueError("max_new_tokens must be at least 1")
    if return_logprob:
        fields["logprobs"] = top_logprobs_num
        if logprob_start_len >= 0:
            fields["prompt_logprobs"] = top_logprobs_num
    try:
        return SamplingParams(**fields)
    except TypeError as exc:  # a value of the wrong type
        raise ValueError(f"bad sampling parameters: {exc}") from None


# ---- the answer -----------------------------------------------------------------------------


def answer(sample: SampleRequest, output: RequestOutput, weight_version: str) -> dict[str, Any]:
    """SGLang's answer for a sample, finished or not: `text`, `output_ids` (everything so far)
    and `meta_info`. `weight_version` is the engine's, for a request that sampled nothing."""
    completion = output.outputs[0] if output.outputs else CompletionOutput(0, "", [])
    spans = completion.weight_versions
    meta: dict[str, Any] = {
        "id": sample.rid,
        "finish_reason": finish_reason(completion, sample.params),
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": len(completion.token_ids),
        "cached_tokens": output.num_cached_tokens,
        "weight_version": spans[-1].version if spans else weight_version,
        # shoal's: which weights sampled which tokens (indices into output_ids).
        "weight_versions": [{"version": s.version, "start": s.start, "end": s.end} for s in spans],
    }
    if sample.return_logprob:
        meta.update(_logprobs(sample, output, completion))
    if sample.return_routed_experts:
        meta["routed_experts"] = _routed_experts(completion, sample.routed_experts_start_len)
    return {"text": completion.text, "output_ids": list(completion.token_ids), "meta_info": meta}


def finish_reason(completion: CompletionOutput, params: SamplingParams) -> dict[str, Any] | None:
    """SGLang's: {"type": "stop", "matched": the stop token id or string}, {"type": "length",
    "length": max_new_tokens}, {"type": "abort", "message": ...}; None while running."""
    reason = completion.finish_reason
    if reason is None:
        return None
    if reason == "stop":
        matched = completion.stop_reason
        if matched is None and completion.token_ids:  # the eos token
            matched = completion.token_ids[-1]
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": params.max_tokens or len(completion.token_ids)}
    return {"type": "abort", "message": "Aborted."}


def _logprobs(sample: SampleRequest, output: RequestOutput, completion: CompletionOutput) -> dict[str, Any]:
    """SGLang's logprob fields: per token [logprob, token id, text or null]; the top ones per
    position, when asked for."""
    text = sample.return_text_in_logprobs
    positions = completion.logprobs or []
    fields: dict[str, Any] = {
        "output_token_logprobs": [
            _entry(token_id, position.get(token_id), text)
            for token_id, position in zip(completion.token_ids, positions)
        ]
    }
    top = sample.top_logprobs_num
    if top > 0:
        fields["output_top_logprobs"] = [_top(position, top, text) for position in positions]
    if sample.logprob_start_len >= 0:
        prompt = output.prompt_token_ids[sample.logprob_start_len :]
        prompt_positions = (output.prompt_logprobs or [None] * len(output.prompt_token_ids))[sample.logprob_start_len :]
        fields["input_token_logprobs"] = [
            _entry(token_id, position.get(token_id) if position else None, text)
            for token_id, position in zip(prompt, prompt_positions)
        ]
        if top > 0:
            fields["input_top_logprobs"] = [_top(p, top, text) if p else None for p in prompt_positions]
    return fields


def _entry(token_id: int, logprob: Any, text: bool) -> list[Any]:
    value = None if logprob is None else clamp_logprob(logprob.logprob)  # JSON has no -inf
    return [value, token_id, (logprob.decoded_token if logprob is not None else None) if text else None]


def _top(position: PositionLogprobs, count: int, text: bool) -> list[list[Any]]:
    ranked = sorted(position.items(), key=lambda item: item[1].rank)[:count]
    return [_entry(token_id, logprob, text) for token_id, logprob in ranked]


def _routed_experts(completion: CompletionOutput, start: int) -> str | None:
    """SGLang's encoding: base64 of int32 [num_positions, num_layers, top_k] (C order), the
    positions from `start` on; None for a model without routed experts."""
    ids = completion.routed_experts
    return None if ids is None else base64.b64encode(ids[start:].tobytes()).decode("ascii")
