"""The utility calls the frontend may make on an engine core, and their dispatch by name (one
place for the engine-core process's loop and the in-process clients): the core's own methods
(`CORE_UTILITIES`) and the RL verbs of shoal/rl_verbs.py, which `EngineCore` implements or, for a
verb of the workers' layer, hands to every worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shoal import rl_verbs

if TYPE_CHECKING:
    from shoal.engine_core.engine_core import EngineCore

CORE_UTILITIES = frozenset(
    {
        "collective_rpc",
        "reset_prefix_cache",
        "get_stats",
        "check_health",
        # LoRA adapters (engine_core/lora_control.py)
        "add_lora",
        "remove_lora",
        "list_loras",
        "update_lora_from_tensors",
        "update_lora_from_disk",
        "get_lora_version",
    }
)


def call_utility(core: EngineCore, method: str, args: Sequence[Any]) -> Any:
    """Run the utility call `method(*args)`; a ValueError for a method the frontend may not call."""
    verb = rl_verbs.find(method)
    if verb is not None and verb.layer == "workers":
        return core.executor.collective_rpc(method, tuple(args))  # each worker's answer, rank order
    if verb is None and method not in CORE_UTILITIES:
        raise ValueError(f"the engine core has no utility method {method!r}")
    return getattr(core, method)(*args)
