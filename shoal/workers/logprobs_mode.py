"""What the returned logprobs are (`logprobs_mode`, vLLM's engine argument and names):

| mode | the values of the sampled token and the top-N |
| --- | --- |
| `raw_logprobs` (default) | log_softmax of the model's logits |
| `raw_logits` | the model's logits |
| `processed_logits` | the logits sampling draws from: after penalties, logit_bias, allowed_token_ids, min_tokens, then temperature (not on greedy rows), top-k and top-p, with min-p's cut tokens at -inf as well |
| `processed_logprobs` | log_softmax of `processed_logits`: the log-probabilities of the distribution the token was drawn from |

A structured row's grammar mask comes first in every mode (vLLM's order). Ranks count the
tokens whose value is higher. Prompt logprobs have no sampling parameters applied: `*_logits`
modes give the model's logits there, `*_logprobs` modes their log_softmax.
"""

from __future__ import annotations

import torch

from shoal.config import LOGPROBS_MODES

__all__ = ["LOGPROBS_MODES", "is_raw", "processed_values", "prompt_values", "raw_values", "returns_logits"]


def is_raw(mode: str) -> bool:
    return mode.startswith("raw_")


def returns_logits(mode: str) -> bool:
    return mode.endswith("_logits")


def raw_values(mode: str, logits: torch.Tensor) -> torch.Tensor:
    """A raw mode's values of float32 `logits` [num_rows, vocab], taken before any processing
    (which may write into `logits`)."""
    return logits.clone() if returns_logits(mode) else logits.log_softmax(dim=-1)


def processed_values(
    mode: str, logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor | None
) -> torch.Tensor:
    """A processed mode's values from the penalized `logits` [num_rows, vocab]: scaled by each
    row's `temperature` (1.0 on greedy rows), with `cut` (True: removed by top-k, top-p or
    min-p) at -inf."""
    scaled = logits / temperature[:, None]
    if cut is not None:
        scaled = scaled.masked_fill(cut, -float("inf"))
    return scaled if returns_logits(mode) else scaled.log_softmax(dim=-1)


def prompt_values(mode: str, logits: torch.Tensor) -> torch.Tensor:
    """The values of prompt positions: the logits or their log_softmax, by the mode's kind."""
    logits = logits.float()
    return logits if returns_logits(mode) else logits.log_softmax(dim=-1)
