"""A worker's adapters: the ones registered (name → path), the ones loaded in host memory (an LRU
cache of `max_cpu_loras`), and the ones in the model's `max_loras` GPU slots (LRU too).

Each step names the adapters of its requests (the scheduler lets at most `max_loras` into one
step); those not in a slot take the least recently used slot that this step does not need,
loaded from the CPU cache, which reloads from disk an adapter it had dropped. The step's token →
slot map goes into the `TokenSlots` buffer every LoRA layer reads.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from shoal.config import LoRAConfig
from shoal.kernels.lora import LoRASegments, sort_tokens_by_slot
from shoal.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shoal.lora.expert_layers import ExpertSlots, ModelExperts
from shoal.lora.layers import LoRALayer, TokenSlots, add_lora
from shoal.lora.peft_checkpoint import LoRAAdapter, load_adapter, modules_from_tensors, read_adapter_config
from shoal.step import SchedulerOutput

logger = logging.getLogger(__name__)

# The linear layers an adapter may reach, by the end of their names.
_WRAPPED = (".qkv_proj", ".o_proj", ".gate_up_proj", ".down_proj")


@dataclass(frozen=True)
class Registered:
    lora_int_id: int
    path: str


class LoRASlots:
    def __init__(
        self,
        model: torch.nn.Module,
        lora_config: LoRAConfig,
        num_layers: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_tokens: int,
        skip_idle_steps: bool,
        grouped_min_tokens: int,
    ) -> None:
        self.config = lora_config
        self.num_layers = num_layers
        num_slots = lora_config.max_loras
        self._segments = torch.zeros(2 * num_slots + max_num_tokens, dtype=torch.int32, device=device)
        self.token_slots = TokenSlots(
            torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device),
            LoRASegments.of(self._segments, num_slots),
        )
        self.skip_idle_steps = skip_idle_steps
        # Steps of more tokens than this (never a CUDA graph's) group their tokens by slot.
        self.grouped_min_tokens = grouped_min_tokens
        self.token_slots.active = not skip_idle_steps
        self.token_slots.experts_active = not skip_idle_steps
        self.layers: list[LoRALayer | ExpertSlots] = [*wrap_layers(model, lora_config, self.token_slots, dtype)]
        lora_dtype = dtype if lora_config.lora_dtype == "auto" else getattr(torch, lora_config.lora_dtype)
        self.experts = ModelExperts(
            model, lora_config.max_loras, lora_config.max_lora_rank, self.token_slots, lora_dtype
        )
        self.layers += self.experts.holders
        self.slot_has_experts = [False] * lora_config.max_loras
        self.registered: dict[str, Registered] = {}
        self.cpu_cache: OrderedDict[str, LoRAAdapter] = OrderedDict()
        # Adapters whose weights were replaced in place (RL): the disk no longer has them.
        self.pinned: set[str] = set()
        self.gpu_slots: OrderedDict[str, int] = OrderedDict()  # name → slot, least recently used first
        self.req_adapter: dict[str, str] = {}  # request id → adapter name (requests with one)
        self._num_tokens_set = 0
        pin = device.type == "cuda"
        # Per step: the token slots, then [starts | counts | sorted tokens] (sort_tokens_by_slot).
        self._staging = [
            torch.empty(max_num_tokens + self._segments.numel(), dtype=torch.int32, pin_memory=pin) for _ in range(2)
        ]
        self._stage_index = 0

    # ---- adapters in and out ------------------------------------------------------------------

    def add(self, name: str, lora_int_id: int, path: str) -> None:
        """Register and load the adapter (raises ValueError: a bad adapter changes nothing)."""
        known = self.registered.get(name)
        if known is not None:
            if known.path != path:
                raise ValueError(f"LoRA adapter {name!r} is loaded already from {known.path!r}")
            return
        adapter = load_adapter(name, path, self.config.max_lora_rank, self.num_layers)
        self._check_fits(adapter)
        self.registered[name] = Registered(lora_int_id, path)
        self._cache(adapter)
        logger.info(
            "LoRA adapter %s loaded from %s (rank %d, %d modules)", name, path, adapter.rank, len(adapter.modules)
        )

    def remove(self, name: str) -> None:
        if self.registered.pop(name, None) is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        self.cpu_cache.pop(name, None)
        self.pinned.discard(name)
        slot = self.gpu_slots.pop(name, None)
        if slot is not None:
            self._write_slot(slot, None)

    def update_from_tensors(self, name: str, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """An RL update of adapter `name`: PEFT-named A and B tensors replace its modules' in
        place (checked first: a bad update changes nothing), scaled by its adapter_config.json;
        the adapter is pinned in the CPU cache from then on (the disk no longer has it)."""
        known = self.registered.get(name)
        if known is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        config = read_adapter_config(known.path, self.config.max_lora_rank)
        self._replace_modules(name, modules_from_tensors(named_tensors, config, self.num_layers))

    def update_from_disk(self, name: str, path: str) -> None:
        """Adapter `name` replaced in place by the adapter at `path` (checked first: a bad one
        changes nothing); the name stays, later reloads read `path`."""
        known = self.registered.get(name)
        if known is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        adapter = load_adapter(name, path, self.config.max_lora_rank, self.num_layers)
        self._check_fits(adapter)
        self.registered[name] = Registered(known.lora_int_id, path)
        self.pinned.discard(name)
        self._cache(adapter)
        slot = self.gpu_slots.get(name)
        if slot is not None:
            self._write_slot(slot, adapter)

    def _replace_modules(self, name: str, modules: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        adapter = self._adapter(name)
        updated = LoRAAdapter(name, adapter.path, adapter.rank, {**adapter.modules, **modules})
        updated.rank = max(a.shape[-2] for a, _ in updated.modules.values())  # A [r, in] or the experts' [E, r, in]
        if updated.rank > self.config.max_lora_rank:
            raise ValueError(
                f"LoRA adapter {name!r}: rank {updated.rank} is over max_lora_rank={self.config.max_lora_rank}"
            )
        self._check_fits(updated)
        self.cpu_cache[name] = updated
        self.pinned.add(name)
        slot = self.gpu_slots.get(name)
        if slot is not None:
            self._write_slot(slot, updated)

    def list(self) -> dict[str, int]:
        return {name: known.lora_int_id for name, known in self.registered.items()}

    # ---- a step --------------------------------------------------------------------------------

    def prepare_step(self, scheduler_output: SchedulerOutput, num_scheduled: np.ndarray) -> None:
        """Track the step's requests' adapters, give each adapter of the step a slot, and write
        every token's slot into the buffer the LoRA layers read."""
        for new_req in scheduler_output.new_reqs:
            if new_req.lora_name is not None:
                self.req_adapter[new_req.req_id] = new_req.lora_name
        for req_id in scheduler_output.finished_req_ids:
            self.req_adapter.pop(req_id, None)
        names = [self.req_adapter.get(r) for r in scheduler_output.scheduled_req_ids]
        wanted = {n for n in names if n is not None}
        slot_of = self._assign_slots(wanted)
        req_slots = np.array([-1 if n is None else slot_of[n] for n in names], dtype=np.int32)
        token_slots = np.repeat(req_slots, num_scheduled)
        num_tokens = len(token_slots)
        buffer = self.token_slots.slots
        segments = sort_tokens_by_slot(token_slots, self.config.max_loras)
        staged = self._staged(token_slots, segments)
        buffer[:num_tokens].copy_(staged[:num_tokens], non_blocking=True)
        self._segments[: len(segments)].copy_(staged[num_tokens:], non_blocking=True)
        if self._num_tokens_set > num_tokens:  # a CUDA graph's padding rows: the base model
            buffer[num_tokens : self._num_tokens_set].fill_(-1)
        self._num_tokens_set = num_tokens
        self.token_slots.active = bool(wanted) or not self.skip_idle_steps
        experts = any(self.slot_has_experts[slot] for slot in slot_of.values())
        self.token_slots.experts_active = experts or not self.skip_idle_steps
        self._group_tokens(token_slots, slot_of.values())

    def _staged(self, token_slots: np.ndarray, segments: np.ndarray) -> torch.Tensor:
        """The host copy of the step's token slots and segments, in one of two pinned staging
        buffers used in turn on a GPU (a step's copies may still be queued while the next is
        prepared)."""
        self._stage_index ^= 1
        staging = self._staging[self._stage_index][: len(token_slots) + len(segments)]
        staging.numpy()[: len(token_slots)] = token_slots
        staging.numpy()[len(token_slots) :] = segments
        return staging

    def _group_tokens(self, token_slots: np.ndarray, slots: Iterable[int]) -> None:
        """A long step's rows of each slot, on the device, for the grouped GEMMs."""
        buffer = self.token_slots
        if len(token_slots) < self.grouped_min_tokens:
            buffer.groups, buffer.groups_num_tokens = None, -1
            return
        device = buffer.slots.device
        pin = device.type == "cuda"
        groups = []
        for slot in slots:
            rows = torch.from_numpy(np.flatnonzero(token_slots == slot))
            groups.append((slot, (rows.pin_memory() if pin else rows).to(device, non_blocking=True)))
        buffer.groups = groups
        buffer.groups_num_tokens = len(token_slots)

    def _assign_slots(self, wanted: set[str]) -> dict[str, int]:
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters, over max_loras={self.config.max_loras}")
        for name in wanted:
            if name in self.gpu_slots:
                self.gpu_slots.move_to_end(name)
                continue
            adapter = self._adapter(name)
            slot = self._free_slot(wanted)
            self._write_slot(slot, adapter)
            self.gpu_slots[name] = slot
        return {name: self.gpu_slots[name] for name in wanted}

    def _free_slot(self, wanted: set[str]) -> int:
        used = set(self.gpu_slots.values())
        for slot in range(self.config.max_loras):
            if slot not in used:
                return slot
        victim = next(name for name in self.gpu_slots if name not in wanted)  # least recently used
        return self.gpu_slots.pop(victim)

    def _adapter(self, name: str) -> LoRAAdapter:
        """The adapter's weights from the CPU cache, reloaded from disk if it was dropped."""
        adapter = self.cpu_cache.get(name)
        if adapter is not None:
            self.cpu_cache.move_to_end(name)
            return adapter
        known = self.registered.get(name)
        if known is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        adapter = load_adapter(name, known.path, self.config.max_lora_rank, self.num_layers)
        self._cache(adapter)
        return adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self.cpu_cache[adapter.name] = adapter
        while len(self.cpu_cache) > self.config.max_cpu_loras:
            victim = next((n for n in self.cpu_cache if n not in self.pinned and n != adapter.name), None)
            if victim is None:
                break
            del self.cpu_cache[victim]

    def _check_fits(self, adapter: LoRAAdapter) -> None:
        """Every module of the adapter must reach a layer of this model with the layer's shapes
        (slot_tensors raises ValueError naming the module; modules of layers another pipeline
        stage holds are left to it). The adapter keeps what each layer's slot takes, in the
        slots' dtype (pinned on a GPU machine), so that a slot is filled by plain copies that
        do not hold the host up."""
        self.experts.check(adapter.modules)
        pin = self.token_slots.slots.device.type == "cuda"
        slot_form = []
        for layer in self.layers:
            lora_a, lora_b = layer.slot_tensors(adapter.modules)  # type: ignore[union-attr]
            lora_a, lora_b = lora_a.to(layer.lora_a.dtype), lora_b.to(layer.lora_b.dtype)
            slot_form.append((lora_a.pin_memory(), lora_b.pin_memory()) if pin else (lora_a, lora_b))
        adapter.slot_form = slot_form

    def _write_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        if adapter is not None and adapter.slot_form is None:
            self._check_fits(adapter)
        self.slot_has_experts[slot] = adapter is not None and ModelExperts.has_experts(adapter.modules)
        for i, layer in enumerate(self.layers):
            if adapter is None:
                layer.lora_a[slot].zero_()
                layer.lora_b[slot].zero_()
                continue
            assert adapter.slot_form is not None
            lora_a, lora_b = adapter.slot_form[i]
            layer.lora_a[slot].copy_(lora_a, non_blocking=True)
            layer.lora_b[slot].copy_(lora_b, non_blocking=True)


def wrap_layers(
    model: torch.nn.Module, lora_config: LoRAConfig, token_slots: TokenSlots, dtype: torch.dtype
) -> list[LoRALayer]:
    """Wrap the model's attention and MLP projections (shoal/lora/layers.py); the routed
    experts are `ModelExperts`' (shoal/lora/expert_layers.py)."""
    lora_dtype = dtype if lora_config.lora_dtype == "auto" else getattr(torch, lora_config.lora_dtype)
    layers = []
    for name, module in list(model.named_modules()):
        fits = isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear))
        if fits and name.endswith(_WRAPPED):
            layers.append(
                add_lora(
                    module, lora_config.max_loras, lora_config.max_lora_rank, token_slots, lora_dtype,
                    lora_config.fully_sharded_loras,
                )
            )  # fmt: skip
    if not layers:
        raise ValueError(f"{type(model).__name__} has no projections LoRA can adapt")
    return layers
