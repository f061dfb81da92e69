"""`LoRARequest`: which adapter a request runs with, under vLLM's names
(`from shoal.lora.request import LoRARequest`, as `from vllm.lora.request import LoRARequest`).

An adapter is known by its name (what the OpenAI `model` field and the engine's step carry) and
loaded from `lora_path`, a folder in PEFT's layout (adapter_config.json and
adapter_model.safetensors). `lora_int_id` is the caller's number for it, kept for vLLM's API:
two requests with the same name must name the same adapter.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    # vLLM's older spelling of the path.
    lora_local_path: str | None = None
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRARequest needs a lora_name")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a lora_path")

    @property
    def path(self) -> str:
        return self.lora_path or self.lora_local_path or ""

    @property
    def name(self) -> str:
        return self.lora_name
