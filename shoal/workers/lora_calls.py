"""A worker's side of the LoRA utility calls (`EngineCore.add_lora` and the rest): each returns
an error string (None when done) rather than raising, so that every worker's answer reaches the
engine core, which raises it as a ValueError, under Ray as in-process."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.lora.slots import LoRASlots
    from shoal.workers.worker import Worker


class LoRACalls:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    @property
    def slots(self) -> LoRASlots:
        lora = self.worker.runner.lora
        if lora is None:
            raise ValueError("LoRA is not enabled on this engine (enable_lora=True)")
        return lora

    def add(self, name: str, lora_int_id: int, path: str) -> str | None:
        try:
            self.slots.add(name, lora_int_id, path)
        except ValueError as exc:
            return str(exc)
        return None

    def remove(self, name: str) -> str | None:
        try:
            self.slots.remove(name)
        except ValueError as exc:
            return str(exc)
        return None

    def list(self) -> dict[str, int]:
        return self.slots.list()

    def update_from_tensors(self, name: str, payload: bytes) -> str | None:
        """Adapter `name`'s modules replaced by the PEFT-named tensors of a safetensors `payload`
        (`...q_proj.lora_A.weight`, as a trainer's `get_peft_model_state_dict` names them)."""
        from safetensors.torch import load

        try:
            self.slots.update_from_tensors(name, list(load(payload).items()))
        except ValueError as exc:
            return str(exc)
        return None

    def update_from_disk(self, name: str, path: str) -> str | None:
        try:
            self.slots.update_from_disk(name, path)
        except ValueError as exc:
            return str(exc)
        return None
