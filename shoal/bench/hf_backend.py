"""The same offline workload through Hugging Face transformers' `generate`, in this process.

transformers has no continuous batching, so requests run in static padded batches: sorted by
output length (then prompt length) so that a batch wastes little, at most `batch_size` a batch,
prompts left-padded, each batch generating its longest output (`min_new_tokens` =
`max_new_tokens`, which emulates `ignore_eos`). A request is credited only with its own output
length: tokens a batch generates past it are the price of static batching. Greedy or sampled
(temperature, no top-k/top-p) as the workload says. A config-only folder (`load_format="dummy"`)
gets transformers' random initialization of the same shapes, on the device.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from shoal.bench.workloads import BenchRequest
from shoal.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HFRun:
    elapsed_s: float
    num_batches: int
    num_generated_tokens: int  # every token the batches generated, wasted ones included


def load_hf_model(model_config: ModelConfig, device: str) -> Any:
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, model_config.dtype)
    start = time.perf_counter()
    if model_config.load_format == "dummy":
        with torch.device(device):
            # A copy: transformers writes into the config it is given (attention implementation, ...).
            model = AutoModelForCausalLM.from_config(
                copy.deepcopy(model_config.hf_config), dtype=dtype, trust_remote_code=False
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_config.model, dtype=dtype, trust_remote_code=False)
        model = model.to(device)
    logger.info(
        "transformers loaded %s on %s in %.1f s", model_config.architecture, device, time.perf_counter() - start
    )
    return model.eval()


def pad_token_id(model: Any, tokenizer: Any) -> int:
    for candidate in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(model.config, "pad_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
    ):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def batches_by_output_len(requests: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Requests sorted by (output length, prompt length), cut into batches of `batch_size`."""
    ordered = sorted(requests, key=lambda r: (r.output_len, r.prompt_len))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def generate_batch(model: Any, batch: list[BenchRequest], max_new_tokens: int, temperature: float, pad_id: int) -> int:
    """Left-padded generation of exactly `max_new_tokens` for every request of `batch`;
    returns the number of tokens generated (batch × new tokens)."""
    import torch

    device = model.device
    width = max(r.prompt_len for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        input_ids[row, width - request.prompt_len :] = torch.tensor(request.prompt_token_ids)
        attention_mask[row, width - request.prompt_len :] = 1
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    with torch.inference_mode():
        output = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=pad_id,
            **sampling,
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (output.shape[1] - width) * len(batch)


def run_workload(model: Any, requests: list[BenchRequest], batch_size: int, temperature: float, pad_id: int) -> HFRun:
    """Every request through `generate`, in batches of equal-ish output length; timed."""
    batches = batches_by_output_len(requests, batch_size)
    start = time.perf_counter()
    generated = 0
    for batch in batches:
        generated += generate_batch(model, batch, max(r.output_len for r in batch), temperature, pad_id)
    return HFRun(time.perf_counter() - start, len(batches), generated)


def warm_up(model: Any, requests: list[BenchRequest], temperature: float, pad_id: int) -> None:
    """A short batch first, so that one-time costs (kernel selection, allocator growth) stay out."""
    batch = requests[: min(len(requests), 4)]
    generate_batch(model, batch, min(4, max(r.output_len for r in batch)), temperature, pad_id)


def release_memory() -> None:
    """Return a dropped model's GPU memory to the device (call after the last reference is gone)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
