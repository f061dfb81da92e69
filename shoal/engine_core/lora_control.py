"""`LoRAControl` (the engine core inherits it): adapters loaded and unloaded at run time, and
replaced in place by an RL trainer, on every worker; a weight version per adapter.

Each worker answers with an error string (None: done) so that one bad adapter is a ValueError
for the caller and changes nothing: an adapter some workers took is removed from them again.
The prefix cache is keyed by adapter name (kv_cache_manager.py), so when an adapter's weights
change (unloaded, or updated in place) the cache is reset: no block computed with the old
weights is found again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.config import EngineConfig
    from shoal.engine_core.scheduler import Scheduler
    from shoal.executors.abstract import Executor


class LoRAControl:
    config: EngineConfig
    executor: Executor
    scheduler: Scheduler
    lora_versions: dict[str, int]

    def add_lora(self, name: str, lora_int_id: int, path: str) -> bool:
        self._require_lora()
        errors = [e for e in self.executor.collective_rpc("add_lora", (name, lora_int_id, path)) if e]
        if errors:
            self.executor.collective_rpc("remove_lora", (name,))  # from the workers that took it
            raise ValueError(errors[0])
        self.lora_versions.setdefault(name, 0)
        return True

    def remove_lora(self, name: str) -> bool:
        self._require_lora()
        in_use = [r.request_id for r in self.scheduler.requests.values() if r.lora_name == name]
        if in_use:
            raise ValueError(
                f"LoRA adapter {name!r} has {len(in_use)} request(s) in flight; unload it once they finish"
            )
        errors = [e for e in self.executor.collective_rpc("remove_lora", (name,)) if e]
        if errors:
            raise ValueError(errors[0])
        self.lora_versions.pop(name, None)
        self.scheduler.reset_prefix_cache()
        return True

    def list_loras(self) -> dict[str, int]:
        """Adapter name → its lora_int_id, as the first worker holds them."""
        if self.config.lora_config is None:
            return {}
        return self.executor.collective_rpc("list_loras")[0]

    def update_lora_from_tensors(self, name: str, payload: bytes) -> str:
        """Replace adapter `name`'s weights by a safetensors `payload` of PEFT-named tensors;
        returns the adapter's new weight version."""
        return self._update_lora("update_lora_from_tensors", name, payload)

    def update_lora_from_disk(self, name: str, path: str) -> str:
        """Replace adapter `name` by the adapter saved at `path`; returns its new weight version."""
        return self._update_lora("update_lora_from_disk", name, path)

    def _update_lora(self, method: str, name: str, source: bytes | str) -> str:
        """Every worker replaces the adapter in place (requests running with it go on with the
        new weights from their next step, as a base-model update in place does); a refusal
        changes nothing. Its blocks in the prefix cache go: they hold the old weights' KV."""
        self._require_lora()
        errors = [e for e in self.executor.collective_rpc(method, (name, source)) if e]
        if errors:
            raise ValueError(errors[0])
        self.lora_versions[name] = self.lora_versions.get(name, 0) + 1
        self.scheduler.reset_prefix_cache()
        return str(self.lora_versions[name])

    def get_lora_version(self, name: str) -> str:
        if name not in self.lora_versions:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        return str(self.lora_versions[name])

    def _require_lora(self) -> None:
        if self.config.lora_config is None:
            raise ValueError("LoRA is not enabled on this engine (start it with enable_lora=True / --enable-lora)")
