"""The frontend's record of the engine's LoRA adapters (name → `LoRARequest`), and the lists of
`lora_request` that `LLM.generate` takes (one for every prompt, or one per prompt).

A request names an adapter the engine has loaded (by name: the path of a later request with
the same name is not read again); `LLM.generate(lora_request=...)` loads the
ones it has not seen first (`add_lora`: a bad adapter is a ValueError before anything is
queued). The server loads them at start (`--lora-modules`) or through its routes.
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.lora.request import LoRARequest


class LoRAAdapters:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.loaded: dict[str, LoRARequest] = {}

    def needs_loading(self, lora_request: LoRARequest) -> bool:
        """Whether the engine must load it first; a ValueError if it may not be served."""
        if not self.enabled:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True (--enable-lora)")
        # An adapter is known by its name (as vLLM's by its id): once loaded, a request naming it
        # runs with what the engine holds, also after an in-place update from another path.
        return lora_request.lora_name not in self.loaded

    def name_of(self, lora_request: LoRARequest | None) -> str | None:
        if lora_request is None:
            return None
        if lora_request.lora_name not in self.loaded:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} is not loaded")
        return lora_request.lora_name


def as_lora_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from vLLM's forms of the argument."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    requests = list(lora_request)
    if len(requests) != num_prompts:
        raise ValueError(f"got {len(requests)} lora_request for {num_prompts} prompts")
    if not all(r is None or isinstance(r, LoRARequest) for r in requests):
        raise ValueError("lora_request must be LoRARequest objects (or None)")
    return requests
