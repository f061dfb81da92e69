"""shoal: a distributed LLM inference and serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.logger import configure_logging
from shoal.lora.request import LoRARequest
from shoal.outputs import CompletionOutput, Logprob, RequestOutput, WeightVersionSpan
from shoal.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from shoal.frontend.llm import LLM

__version__ = "0.1.0"
configure_logging()
__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "WeightVersionSpan",
    "__version__",
]


def __getattr__(name: str) -> object:
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from shoal.frontend.llm import LLM

        return LLM
    raise AttributeError(f"module 'shoal' has no attribute {name!r}")
